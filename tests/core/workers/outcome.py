"""What a call did, as the mismatch workers report it: into ``out[name]`` "no error",
"DDLMismatchError" or the error's type (with ``out[name + "_msg"]`` its message)."""

import ddl


def record(out: dict, name: str, call) -> None:
    try:
        call()
        out[name] = "no error"
    except ddl.DDLMismatchError as exc:
        out[name] = "DDLMismatchError"
        out[f"{name}_msg"] = str(exc)[:300]
    except Exception as exc:  # noqa: BLE001 - reported
        out[name] = type(exc).__name__
        out[f"{name}_msg"] = str(exc)[:300]
