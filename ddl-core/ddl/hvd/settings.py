"""The environment variables the Horovod layer reads (ddl.torch, ddl.tensorflow, ddl.keras);
they live in the core's one registry (``ddl.config``). Optimizer arguments override both."""

from __future__ import annotations

from ddl import config


def fusion_threshold_bytes() -> int:
    return int(config.get("DDL_FUSION_THRESHOLD"))


def cycle_time_ms() -> float:
    return float(config.get("DDL_CYCLE_TIME"))


def stall_check_s() -> float | None:
    """Seconds before the stall warning of a named call; None when disabled."""
    if config.get("HOROVOD_STALL_CHECK_DISABLE"):
        return None
    return float(config.get("HOROVOD_STALL_CHECK_TIME_SECONDS"))


def stall_shutdown_s() -> float:
    """Seconds before a stalled named call fails everywhere; 0: never."""
    return float(config.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"))
