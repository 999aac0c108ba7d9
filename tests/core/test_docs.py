"""User docs stay in step with the code."""

import os

from ddl import config

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")


def test_every_environment_variable_is_documented():
    with open(os.path.join(DOCS, "tuning.md")) as f:
        text = f.read()
    missing = [n for n, _, _ in config.describe() if f"`{n}`" not in text]
    assert not missing, f"add these to docs/tuning.md (ddl-perf env prints them): {missing}"


def test_every_public_function_is_in_the_api_doc():
    import ddl

    with open(os.path.join(DOCS, "api.md")) as f:
        text = f.read()
    public = [n for n in ddl.__all__ if callable(getattr(ddl, n)) and n[0].islower()]
    missing = [n for n in public if n not in text]
    assert not missing, f"document in docs/api.md: {missing}"
