"""docs/pytorch.md's table of Horovod's API against ddl.torch: every public name of
horovod.torch is in it, "supported" and "differs" names import from ddl.torch, "absent"
ones do not."""

import os
import re

import pytest

import ddl.torch as hvd

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "pytorch.md")
HEADING = "### Horovod's API, name by name"
STATUSES = ("supported", "differs", "absent")

# horovod.torch's public names (Horovod 0.28.1): what horovod/torch/__init__.py imports
# (from elastic, compression, functions, mpi_ops, optimizer, sync_batch_norm), and
# is_homogeneous, which mpi_ops.py defines with the other basics.
HOROVOD_TORCH = [
    "elastic", "Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "sparse_allreduce_async", "allgather", "allgather_async",
    "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size",
    "local_size", "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "HorovodInternalError", "DistributedOptimizer", "SyncBatchNorm", "is_homogeneous"
]

_ROW = re.compile(r"^\|\s*`(?P<name>[A-Za-z_][A-Za-z0-9_]*)`\s*\|\s*(?P<status>[a-z]+)\s*\|")


def parse_table(lines: list[str]) -> dict[str, str]:
    """``name -> status`` from the table under HEADING (up to the next heading)."""
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == HEADING)
    except StopIteration:
        raise AssertionError(f"docs/pytorch.md has no {HEADING!r} section") from None
    rows: dict[str, str] = {}
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        m = _ROW.match(line)
        if m is None:
            continue
        name, status = m["name"], m["status"]
        assert status in STATUSES, f"{name}: status {status!r} is not one of {STATUSES}"
        assert name not in rows, f"{name} is in the table twice"
        rows[name] = status
    return rows


def test_the_parser_reads_rows_and_stops_at_the_next_heading():
    lines = [HEADING, "", "| name | status | notes |", "|---|---|---|",
             "| `allreduce` | supported | x |", "| `Adasum` | absent | y |", "## next",
             "| `barrier` | supported | |"]
    assert parse_table(lines) == {"allreduce": "supported", "Adasum": "absent"}
    with pytest.raises(AssertionError, match="not one of"):
        parse_table([HEADING, "| `x` | maybe | |"])


@pytest.fixture(scope="module")
def table() -> dict[str, str]:
    with open(DOC, encoding="utf-8") as f:
        return parse_table(f.read().splitlines())


def test_every_public_horovod_torch_name_is_in_the_table_and_nothing_else(table):
    assert sorted(set(HOROVOD_TORCH) - set(table)) == []
    assert sorted(set(table) - set(HOROVOD_TORCH)) == []


def test_supported_and_differing_names_import_and_absent_ones_do_not(table):
    for name, status in table.items():
        if status == "absent":
            assert not hasattr(hvd, name), f"{name} is marked absent but ddl.torch has it"
        else:
            assert hasattr(hvd, name), f"{name} is marked {status} but ddl.torch lacks it"
            exec(f"from ddl.torch import {name}", {})  # the spelling scripts use
