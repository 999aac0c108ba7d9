"""Joining a host's control segment: a rank whose settings differ from the creator's
(slot bytes, ranks) fails at once with the error naming them, instead of waiting out the
init timeout (DDLConfigError is a ValueError, which the wait for an empty file catches)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from ddl.engines.segments import unlink
from ddl.engines.shm_attach import ControlSegment
from ddl.errors import DDLConfigError


def test_other_settings_fail_at_once_not_after_the_init_timeout():
    name = f"ddl-test-{uuid.uuid4().hex[:12]}-ctl"
    common = dict(job_id="t", token=7, init_timeout=30.0)
    first = ControlSegment(name, rank=0, size=2, global_rank=0, slot=1 << 16, **common)
    try:
        t0 = time.monotonic()
        with pytest.raises(DDLConfigError, match="same LOCAL_WORLD_SIZE and DDL_SHM_"):
            ControlSegment(name, rank=1, size=2, global_rank=1, slot=1 << 17, **common)
        assert time.monotonic() - t0 < 5  # not the 30 s init timeout
    finally:
        first.close()
        unlink(name)
    assert not os.path.exists(f"/dev/shm/{name}")
