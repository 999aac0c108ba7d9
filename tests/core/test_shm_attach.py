"""Joining a host's control segment: a rank whose settings differ from the creator's
(slot bytes, one-step bound, ranks) fails at once with the error naming them, instead of
waiting out the init timeout (DDLConfigError is a ValueError, which the wait for an empty
file catches)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from ddl.engines.segments import unlink
from ddl.engines.shm_attach import ControlSegment
from ddl.errors import DDLConfigError


@pytest.mark.parametrize("theirs,named", [
    (dict(slot=1 << 17, small=1 << 16), "DDL_SHM_SLOT_BYTES / DDL_SHM_MAX_BYTES"),
    (dict(slot=1 << 16, small=4 << 10), "DDL_SHM_SMALL_BYTES: local rank 0 made"),
])
def test_other_settings_fail_at_once_not_after_the_init_timeout(theirs, named):
    name = f"ddl-test-{uuid.uuid4().hex[:12]}-ctl"
    common = dict(job_id="t", token=7, init_timeout=30.0)
    first = ControlSegment(name, rank=0, size=2, global_rank=0, slot=1 << 16, small=1 << 16,
                           **common)
    try:
        t0 = time.monotonic()
        with pytest.raises(DDLConfigError, match="the ranks on this host differ in") as err:
            ControlSegment(name, rank=1, size=2, global_rank=1, **theirs, **common)
        assert named in str(err.value)
        assert time.monotonic() - t0 < 5  # not the 30 s init timeout
    finally:
        first.close()
        unlink(name)
    assert not os.path.exists(f"/dev/shm/{name}")
