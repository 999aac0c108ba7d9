import pytest

from ddl import grid, options
from ddl.errors import DDLConfigError


def _plan(rank, world, local, text):
    return grid.plan(rank, world, local, options.parse(text))


def test_two_hosts_of_two():
    g = _plan(3, 4, 2, "-mode b:2x2")
    d0, d1 = g.dims
    assert d0.members == (2, 3) and d0.position == 1 and d0.intra_host
    assert d1.members == (1, 3) and d1.position == 1 and not d1.intra_host
    assert g.describe() == "2(host):b x 2:b"


def test_every_line_partitions_the_world():
    world, dims = 8, "2x2x2"
    for k in range(3):
        lines = {_plan(r, world, 2, f"-mode r:{dims}").dims[k].members for r in range(world)}
        assert sorted(m for line in lines for m in line) == list(range(world))
        assert all(len(line) == 2 for line in lines)


def test_per_dimension_letters_and_default_flat():
    g = _plan(0, 8, 4, "-mode rn:4x2")
    assert [d.mode for d in g.dims] == ["r", "n"]
    flat = _plan(5, 8, 4, "")
    assert flat.shape == (8,) and not flat.dims[0].intra_host
    assert _plan(1, 4, 4, "").dims[0].intra_host


def test_dimension_spanning_hosts_is_not_intra_host():
    g = _plan(0, 8, 2, "-mode b:4x2")  # 4 consecutive ranks = 2 hosts
    assert not g.dims[0].intra_host


def test_grid_must_match():
    with pytest.raises(DDLConfigError, match="describes 6 ranks but the job has 8"):
        _plan(0, 8, 2, "-mode b:3x2")


def test_default_dims():
    assert grid.default_dims(8, 4) == (4, 2)
    assert grid.default_dims(4, 4) == (4,)
    assert grid.default_dims(6, 4) == (6,)


def test_the_identity_rounds_host_line():
    """The ranks at one place on every host, where the grid is the host's ranks then any
    dimensions across hosts (IBM DDL's GPUs x hosts x racks); None where it is not."""
    # 4 hosts of 2 as 2 x 2 x 2: rank 5 is local rank 1 of host 2
    assert grid.host_line(_plan(5, 8, 2, "-mode r:2x2x2"), 5, 2) == ((1, 3, 5, 7), 2)
    # 2 hosts of 2 as 2 x 2: the line is the one dimension across hosts
    g = _plan(3, 4, 2, "-mode r:2x2")
    assert grid.host_line(g, 3, 2) == (g.dims[1].members, g.dims[1].position)
    # 3 racks of 2 hosts of 4
    assert grid.host_line(_plan(13, 24, 4, "-mode r:4x2x3"), 13, 4) == (
        (1, 5, 9, 13, 17, 21), 3)
    assert grid.host_line(_plan(0, 8, 4, "-mode r:2x2x2"), 0, 4) is None  # two inside a host
    assert grid.host_line(_plan(0, 8, 2, "-mode r:4x2"), 0, 2) is None  # none is the host
    assert grid.host_line(_plan(0, 4, 1, "-mode r:2x2"), 0, 1) is None  # one rank per host
    assert grid.host_line(_plan(0, 8, 2, ""), 0, 2) is None  # flat
