"""The environment variables the Horovod layer reads (ddl.torch, ddl.tensorflow, ddl.keras);
they live in the core's one registry (``ddl.config``). Optimizer arguments override both."""

from __future__ import annotations

from ddl import config


def fusion_threshold_bytes() -> int:
    return int(config.get("DDL_FUSION_THRESHOLD"))


def cycle_time_ms() -> float:
    return float(config.get("DDL_CYCLE_TIME"))
