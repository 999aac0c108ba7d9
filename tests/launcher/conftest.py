"""Fixtures for the ddlrun tests (helpers live in ddlrun_testlib)."""

from ddlrun_testlib import marker  # noqa: F401  (fixture)
