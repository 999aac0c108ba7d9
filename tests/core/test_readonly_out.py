"""A read-only output array is refused before any data moves, and the job stays usable."""

import numpy as np
import pytest

from ddl import tensors
from ddl.errors import DDLConfigError

from .util import reports, run_worker


def test_writable_refuses_a_read_only_numpy_array_and_names_it():
    a = np.ones(4, np.float32)
    assert tensors.writable(tensors.flatten(a), "allreduce").original is a
    a.flags.writeable = False
    with pytest.raises(DDLConfigError, match=r"allreduce: out is a read-only numpy array "
                                             r"\(writeable=False\)"):
        tensors.writable(tensors.flatten(a, name="out"), "allreduce", "out")
    # a strided one is staged through a writable copy: the original still cannot take it
    b = np.ones((4, 8), np.float32)[:, ::2]
    b.flags.writeable = False
    with pytest.raises(DDLConfigError, match="tensor is a read-only .* out-of-place variant"):
        tensors.writable(tensors.flatten(b), "allreduce")


def test_a_read_only_output_is_refused_on_its_rank_and_the_job_stays_in_step():
    """numpy's ValueError used to come after the data moved, with the engine out of step."""
    n = 2
    reps = reports(run_worker("readonly_out.py", n, env={"DDL_TIMEOUT": "20"}, timeout=120))
    for r in reps:
        refusing = r["rank"] == n - 1
        for case in ("inplace", "inplace_async", "strided", "out", "broadcast", "grouped"):
            if refusing:
                assert r[case] == "DDLConfigError", (r, case)
                assert "read-only numpy array" in r[f"{case}_msg"], (r, case)
            else:
                assert r[case] == "DDLMismatchError", (r["rank"], case, r.get(f"{case}_msg"))
            assert r[f"{case}_after"], (r["rank"], case)
        assert r["everyone"] == "DDLConfigError" and r["everyone_after"], r
        assert r["untouched"], r
