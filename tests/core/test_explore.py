"""Mode 'p': every dimension across hosts times its algorithms per size range at start,
and every member of the dimension makes the same choice for the same call, whatever its
own clock said (ranks that picked differently would run different steps and hang or mix
data)."""

import numpy as np
import pytest

from ddl.algorithms import dims
from ddl.dtypes import BY_NAME
from ddl.ops import ReduceOp


class Group:
    """A dimension's group as explore() sees it: the only collective it runs outside the
    timed (faked) loops is the MAX that agrees on the times, against ``others``' times."""

    name = "gloo"

    def __init__(self, rank: int, size: int, others: list[np.ndarray]):
        self.rank, self.size, self.others = rank, size, others
        self.agreements = 0

    def native_ok(self, dt) -> bool:
        return True

    def allreduce(self, buf, dt, op) -> None:
        if buf.dtype == np.float64 and op is ReduceOp.MAX:
            self.agreements += 1
            for theirs in self.others:
                np.maximum(buf, theirs, out=buf)


class Timed(dims.GroupDim):
    """A member whose clock says ``seconds[(size, alg)]`` per call."""

    def __init__(self, seconds: dict, group: Group):
        super().__init__(group, 1, "p")
        self.seconds = seconds

    def _time(self, alg, buf, dt, reps):
        return self.seconds[(buf.nbytes, alg)]


def _times(fast_small: str, fast_big: str) -> dict:
    cands = ["ring", "native", "hd"]
    out = {}
    for size in dims.EXPLORE_SIZES:
        fast = fast_small if size < 1 << 20 else fast_big
        for k, alg in enumerate(cands):
            out[(size, alg)] = 1e-3 * (1 if alg == fast else 2 + k)
    return out


def _local(seconds: dict) -> np.ndarray:
    return np.array([seconds[(s, a)] for s in dims.EXPLORE_SIZES
                     for a in ("ring", "native", "hd")], np.float64)


def test_members_whose_clocks_disagree_choose_alike_per_size_range():
    # rank 0's clock: hd fastest for small, native for big; rank 1's: ring and hd
    mine, theirs = _times("hd", "native"), _times("ring", "hd")
    a = Timed(mine, Group(0, 2, [_local(theirs)]))
    b = Timed(theirs, Group(1, 2, [_local(mine)]))
    ta, tb = a.explore(BY_NAME["float32"]), b.explore(BY_NAME["float32"])
    assert ta == tb  # the agreed (max) times, the same numbers on both
    assert a.picks == b.picks
    assert a.group.agreements == b.group.agreements == 1
    for nbytes in (8 << 10, 32 << 10, 100 << 10, 1 << 20, 64 << 20):
        assert a.choose(nbytes) == b.choose(nbytes)
    # the choice per range is the smallest agreed time
    small, big = ta[32 << 10], ta[1 << 20]
    assert a.choose(32 << 10) == min(small, key=small.get)
    assert a.choose(64 << 20) == min(big, key=big.get)
    bound = a.picks[0][0]
    assert bound == int(((32 << 10) * (1 << 20)) ** 0.5)
    assert a.choose(bound) == a.choose(32 << 10) and a.choose(bound + 1) == a.choose(1 << 20)
    assert "dim1 x2 gloo/[" in a.describe() and "from" in a.describe()


def test_a_tie_is_broken_by_name_on_every_member():
    same = {(s, a): 1e-3 for s in dims.EXPLORE_SIZES for a in ("ring", "native", "hd")}
    a = Timed(same, Group(0, 2, [_local(same)]))
    a.explore(BY_NAME["float32"])
    assert {alg for _, alg in a.picks} == {"hd"}  # min by (time, name)


def test_modes_r_and_n_never_explore_and_b_prices_per_size():
    g = Group(0, 2, [])
    assert dims.GroupDim(g, 1, "r").choose(1 << 30) == "ring"
    assert dims.GroupDim(g, 1, "n").choose(1) == "native"
    b = dims.GroupDim(g, 1, "b")
    assert not b.picks and b.choose(64 << 20) in b.candidates()


@pytest.mark.parametrize("alg", ["ring", "native", "hd"])
def test_timing_a_candidate_leaves_the_dimension_unfixed(alg):
    class Counting(Group):
        calls = 0

        def allreduce(self, buf, dt, op):
            Counting.calls += 1

        def allgather_bytes(self, mine, buf):
            Counting.calls += 1

    d = dims.GroupDim(Counting(0, 1, []), 1, "p")
    d.size = 1  # one member: ring and hd exchange nothing, native calls the group
    assert d._time(alg, np.zeros(4, np.float32), BY_NAME["float32"], 2) >= 0
    assert d.fixed is None


class Second(Group):
    """Another engine's group of the same ranks (Gloo beside MPI): records its calls."""

    name = "gloo"

    def __init__(self, *a, native=True):
        super().__init__(*a)
        self.calls, self._native = [], native

    def native_ok(self, dt) -> bool:
        return self._native

    def allreduce(self, buf, dt, op) -> None:
        self.calls.append(("allreduce", buf.size))


class TimedTwo(Timed):
    def __init__(self, seconds: dict, group: Group):
        dims.GroupDim.__init__(self, group, 1, "p", second=Second(group.rank, group.size, []))
        self.seconds = seconds


def test_a_second_engine_is_explored_and_its_pick_agreed_per_size_range():
    cands = ["ring", "native", "hd", "gloo:native"]

    sizes = dims.EXPLORE_SIZES_TWO_ENGINES  # a third size, where bandwidth rules

    def clock(fast_small, fast_big):
        return {(s, a): 1e-3 * (1 if a == (fast_small if s < 1 << 20 else fast_big) else 2 + k)
                for s in sizes for k, a in enumerate(cands)}

    def local(sec):
        return np.array([sec[(s, a)] for s in sizes for a in cands], np.float64)

    # rank 0: MPI's own allreduce fastest for small messages, Gloo's for large ones; rank 1:
    # halving-doubling for small ones: the agreed (max) times decide for both (ring small)
    mine, theirs = clock("native", "gloo:native"), clock("hd", "gloo:native")
    a = TimedTwo(mine, Group(0, 2, [local(theirs)]))
    b = TimedTwo(theirs, Group(1, 2, [local(mine)]))
    assert a.candidates() == cands
    a.explore(BY_NAME["float32"])
    b.explore(BY_NAME["float32"])
    assert [bound for bound, _ in a.picks] == [int(((32 << 10) * (1 << 20)) ** 0.5),
                                               int(((1 << 20) * (8 << 20)) ** 0.5), 8 << 20]
    assert a.picks == b.picks
    for nbytes in (4 << 10, 32 << 10, 1 << 20, 64 << 20):
        assert a.choose(nbytes) == b.choose(nbytes)
    assert a.choose(4 << 10) == "ring" and a.choose(64 << 20) == "gloo:native"
    # a pick on the second engine runs its collective there, not on the job's own group
    a.picks = [(1 << 20, "native"), (1 << 20, "gloo:native")]
    buf = np.zeros(1 << 20, np.float32)
    a.allreduce(buf, BY_NAME["float32"], ReduceOp.SUM)
    assert a.second.calls == [("allreduce", buf.size)]
    assert "gloo:native from" in a.describe()


def test_mode_b_prices_a_second_engine_only_from_a_measured_link():
    from ddl import cost

    g = Group(0, 4, [])
    slow_mpi = cost.Link(alpha=1e-6, beta=1 / 0.5e9)  # fast to start, slow to stream
    fast_gloo = cost.Link(alpha=500e-6, beta=1 / 5e9)
    unmeasured = dims.GroupDim(g, 1, "b", slow_mpi, second=Second(0, 4, []))
    assert "gloo:native" not in unmeasured.candidates()
    assert unmeasured.choose(64 << 20) != "gloo:native"
    both = dims.GroupDim(g, 1, "b", slow_mpi, second=Second(0, 4, []), second_link=fast_gloo)
    assert both.choose(4 << 10) in ("native", "hd")  # MPI: latency
    assert both.choose(64 << 20) == "gloo:native"  # Gloo: bandwidth
    # equal prices go to the job's own engine
    tie = dims.GroupDim(g, 1, "b", fast_gloo, second=Second(0, 4, []), second_link=fast_gloo)
    assert tie.choose(64 << 20) == "native"
    # a dtype the second engine cannot reduce natively runs ddl's ring on the job's group
    no = dims.GroupDim(Group(0, 1, []), 1, "n", second=Second(0, 1, [], native=False))
    no.fixed = "gloo:native"
    assert no._alg(64, BY_NAME["float32"]) == (no.group, "ring")
