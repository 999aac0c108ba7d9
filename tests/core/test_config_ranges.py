"""Every numeric setting of the registry has the range the code can honour: a value outside
it (or one ``float``/``int`` take but mean nothing by: ``nan``, ``inf``, ``1e30`` bytes, ``²``)
is one DDLConfigError line naming the variable, the value and the range."""

from pathlib import Path

import pytest

from ddl import config
from ddl.engines.shm import ShmEngine, staging_slot
from ddl.engines.shm_attach import one_step_bytes
from ddl.errors import DDLConfigError

ROOT = Path(__file__).resolve().parents[2]
NUMERIC = (config._int, config._number, config._size, config._auto_size, int, float)


def test_every_numeric_variable_has_a_range_and_the_docs_show_it():
    bare = [v.name for v in config.REGISTRY.values() if v.parse in NUMERIC and not v.allowed]
    assert bare == [], f"give these a range (low/high) in ddl/config.py: {bare}"
    assert all(v.low is not None and v.high is not None
               for v in config.REGISTRY.values() if v.allowed)
    # the table in docs/tuning.md is the one `ddl-perf env --markdown` prints (make docs)
    assert config.markdown() in (ROOT / "docs" / "tuning.md").read_text(), \
        "docs/tuning.md's table is stale: run `make docs`"


@pytest.mark.parametrize("name,raw,says", [
    ("DDL_TIMEOUT", "nan", "expected a number, got 'nan'"),
    ("DDL_TIMEOUT", "inf", "expected a number"),
    ("DDL_TIMEOUT", "1e400", "not a finite number"),
    ("DDL_TIMEOUT", "-1", "out of range"),
    ("DDL_TIMEOUT", "0", "out of range"),
    ("DDL_TIMEOUT", "1e-9", "out of range"),
    ("DDL_TIMEOUT", "1e9", "out of range"),
    ("DDL_INIT_TIMEOUT", "nan", "expected a number"),
    ("DDL_RENDEZVOUS_SETTLE", "-1", "out of range"),
    ("DDL_PORT", "70000", "out of range"),
    ("DDL_PORT", "0", "out of range"),
    ("DDL_PORT", "²", "expected a whole number, got '²'"),
    ("MASTER_PORT", "65536", "out of range"),
    ("DDL_SHM_HEAP_BYTES", "1e30", "out of range"),
    ("DDL_SHM_HEAP_BYTES", "1e9999", "out of range"),
    ("DDL_SHM_HEAP_BYTES", "nan", "expected bytes like"),
    ("DDL_SHM_SMALL_BYTES", "automatic", "expected bytes like"),
    ("DDL_SHM_SMALL_BYTES", "2P", "out of range"),
    ("DDL_SHM_SLOT_BYTES", "0", "out of range"),
    ("DDL_SHM_SLOT_BYTES", "3", "out of range"),
    ("DDL_SHM_SLOT_BYTES", "1K", "out of range"),
    ("DDL_SHM_SLOT_BYTES", "-4M", "must not be negative"),
    ("DDL_SHM_MAX_BYTES", "64K", "out of range"),
    ("DDL_CHUNK_BYTES", "1K", "out of range"),
    ("DDL_FUSION_THRESHOLD", "2P", "out of range"),
    ("DDL_CYCLE_TIME", "-1", "out of range"),
    ("RANK", "-1", "out of range"),
    ("RANK", "1_0", "expected a whole number"),
    ("WORLD_SIZE", "0", "out of range"),
    ("LOCAL_WORLD_SIZE", "5000", "out of range"),
])
def test_a_bad_value_is_one_line_naming_the_variable_value_and_range(name, raw, says):
    with pytest.raises(DDLConfigError) as err:
        config.get(name, {name: raw})
    msg = str(err.value)
    assert msg.startswith(f"{name}={raw!r} is ") and says in msg, msg
    assert msg.endswith(f"(allowed: {config.REGISTRY[name].allowed})"), msg
    assert "\n" not in msg


@pytest.mark.parametrize("name,raw,value", [
    ("DDL_TIMEOUT", "0.001", 0.001),
    ("DDL_TIMEOUT", "604800", 604800.0),
    ("DDL_TIMEOUT", " 2.5 ", 2.5),
    ("DDL_PORT", "1", 1),
    ("DDL_PORT", "65535", 65535),
    ("DDL_SHM_SLOT_BYTES", "64K", 64 << 10),
    ("DDL_SHM_SLOT_BYTES", "4MiB", 4 << 20),
    ("DDL_SHM_SLOT_BYTES", "1.5M", 3 << 19),
    ("DDL_SHM_HEAP_BYTES", "1P", 1 << 50),
    ("DDL_SHM_HEAP_BYTES", "0.5G", 512 << 20),
    ("DDL_SHM_SMALL_BYTES", "0", 0),
    ("DDL_SHM_SMALL_BYTES", "64K", 64 << 10),
    ("DDL_SHM_SMALL_BYTES", " Auto ", "auto"),
    ("DDL_SHM_SMALL_BYTES", "", "auto"),
    ("DDL_CYCLE_TIME", "0", 0.0),
])
def test_values_within_the_range_are_taken(name, raw, value):
    assert config.get(name, {name: raw}) == value


def test_the_range_reads_in_the_variable_s_units():
    assert config.REGISTRY["DDL_SHM_SLOT_BYTES"].allowed == "64K..1P bytes"
    assert config.REGISTRY["DDL_TIMEOUT"].allowed == "0.001..604800 seconds"
    assert config.REGISTRY["DDL_PORT"].allowed == "1..65535"
    assert config.REGISTRY["DDL_OPTIONS"].allowed == ""
    row = next(r for r in config.describe() if r.name == "DDL_SHM_SLOT_BYTES")
    assert (row.default, row.allowed) == ("4M", "64K..1P bytes")
    row = next(r for r in config.describe() if r.name == "DDL_SHM_SMALL_BYTES")
    assert (row.default, row.allowed) == ("auto", "0..1P bytes")


def test_the_store_port_must_exist():
    assert config.store_port(29500) == 29501
    assert config.store_port(65535, 1000) == 1000
    with pytest.raises(DDLConfigError, match=r"MASTER_PORT=65535 leaves no port for ddl's "
                                             r"store .* set DDL_PORT, or a lower MASTER_PORT"):
        config.store_port(65535)


def test_staging_blames_the_variable_at_fault():
    assert staging_slot(4 << 20, 32 << 20, 2) == 4 << 20
    assert staging_slot(4 << 20, 1 << 20, 2) == 256 << 10  # capped by the area
    with pytest.raises(DDLConfigError, match=r"DDL_SHM_SLOT_BYTES=3 is below .* 64K"):
        staging_slot(3, 32 << 20, 2)
    with pytest.raises(DDLConfigError, match=r"DDL_SHM_SLOT_BYTES=1K is below"):
        staging_slot(1 << 10, 32 << 20, 2)
    with pytest.raises(DDLConfigError, match=r"DDL_SHM_MAX_BYTES=128K leaves 32768 bytes .* "
                                             r"2 ranks .* DDL_SHM_MAX_BYTES=256K or more"):
        staging_slot(4 << 20, 128 << 10, 2)
    # the engine asks it first, before it creates or attaches anything
    with pytest.raises(DDLConfigError, match="DDL_SHM_SLOT_BYTES=3 is below"):
        ShmEngine(job_id="ranges", host_index=0, local_rank=0, local_size=2, global_rank=0,
                  slot_bytes=3, token=1)


def test_the_one_step_bound_follows_the_ranks_on_the_host():
    """``auto``: 256 KiB with two ranks on the host, 64 KiB with any other count; a number
    is taken as given; never more than a staging slot holds."""
    slot = 4 << 20
    assert one_step_bytes("auto", 2, slot) == 256 << 10
    assert [one_step_bytes("auto", n, slot) for n in (1, 3, 4, 8)] == [64 << 10] * 4
    assert one_step_bytes(1 << 20, 4, slot) == 1 << 20
    assert one_step_bytes(0, 2, slot) == 0
    assert one_step_bytes("auto", 2, 128 << 10) == 128 << 10
