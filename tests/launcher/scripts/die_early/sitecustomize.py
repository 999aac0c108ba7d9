"""Test-only fault injection for tests/launcher/test_perf_spawn.py: with this folder on
PYTHONPATH, the process whose RANK equals DDLTEST_DIE_RANK exits at interpreter start with
DDLTEST_DIE_CODE (default 7), before it can join its job. Processes without that RANK (the
launcher itself) are untouched."""

import os

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get(
        "DDLTEST_DIE_RANK"):
    os._exit(int(os.environ.get("DDLTEST_DIE_CODE", "7")))
