"""Metadata records of the shared-memory engine: what each rank says its collective is.

In the first step of every collective each rank writes one 16-word record (per parity, in
its control block) next to its data: the collective and op, dtype, element count, a shape
hash, root, where its buffers live in its ``ddl.malloc`` heap, and the first dimensions.
After that step's synchronisation every rank compares the records in the word spans that
must agree for that collective; all ranks read the same records, so a mismatch raises
``DDLMismatchError`` on every rank at the same step and the engine stays in step.

The same step may carry a Horovod-level call's identity (its descriptor, ddl.hvd.negotiate)
in a second record: ``Fold``, ``Identities`` and ``Unfolded`` below, used by the engine's
``fold_identity`` and ``exchange_identity``.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..dtypes import BY_CODE
from ..errors import DDLConfigError, DDLMismatchError
from ..ops import ReduceOp

W_META = (16, 32)  # control-block word of the record of each parity
RECORD_WORDS = 16
# call identities (see the section at the end)
W_IDENT = (48, 144)
IDENT_WORDS = 96
MAX_IDENT = IDENT_WORDS - 1
IDENT_SHIFT = 12  # key word = collective * 16 + op, plus the identity flag from this bit
NO_IDENT, FOLDED, ALONE = 0, 1, 2  # the flag: none (a core call), with data, on its own
# record words
M_KEY, M_DTYPE, M_COUNT, M_SHAPE, M_ROOT, M_IN, M_OUT, M_NDIM, M_DIMS = range(9)
MAX_DIMS = 7  # dimensions written out in the record (for the mismatch report)
# word spans compared across ranks: [lo, hi)
SPAN_KEY = ((M_KEY, M_KEY + 1),)
SPAN_REDUCE = ((M_KEY, M_SHAPE + 1),)  # op, dtype, count, shape
SPAN_GATHER = ((M_KEY, M_DTYPE + 1), (M_SHAPE, M_SHAPE + 1))  # counts may differ
SPAN_BCAST = ((M_KEY, M_ROOT + 1),)

BARRIER, ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, IDENTITY, REFUSED = 1, 2, 3, 4, 5, 6, 7
COLL_NAMES = {1: "barrier", 2: "allreduce", 3: "allgather", 4: "broadcast", 5: "reduce_scatter",
              6: "identity exchange", 7: "a call it refused"}


def coll_key(coll: int, op: int = 0) -> int:
    """The record's first word: the collective and its reduction op."""
    return coll * 16 + op


def describe_key(key: int) -> str:
    coll, op = divmod(key & ((1 << IDENT_SHIFT) - 1), 16)
    name = COLL_NAMES.get(coll, f"op#{coll}")
    return f"{name}({ReduceOp(op).name.title()})" if op else name


def shape_hash(shape: tuple[int, ...]) -> int:
    return hash(tuple(int(d) for d in shape)) & ((1 << 62) - 1)


class MetaKey(NamedTuple):
    """What one rank's collective is, as its record says it (and the record cache's key)."""

    coll_key: int
    dtype: int  # dtype code, 0 for none (barrier)
    count: int
    shape: tuple[int, ...]
    root: int = 0  # broadcast: the root; otherwise 0
    in_loc: int = 0  # heap location of the input (0: private memory)
    out_loc: int = 0  # heap location of the output


class Records:
    """Read and write the records of every local rank.

    ``q``/``qb``: the control segment as int64 words and as bytes; ``blocks``: the first
    word of each rank's control block; ``granks``: each local rank's job rank."""

    def __init__(self, q: memoryview, qb: memoryview, blocks: list[int], rank: int,
                 granks: dict[int, int]):
        self._q, self._qb = q, qb
        self._blk = blocks
        self._mine = [blocks[rank] + w for w in W_META]
        self._peer_bytes = [(blocks[i] * 8, i) for i in range(len(blocks)) if i != rank]
        self._grank = granks
        self._me = f"rank {granks[rank]}"
        # encoded records, one cache per identity flag (each flag changes the key word)
        self._caches: tuple[dict[MetaKey, memoryview], ...] = ({}, {}, {})

    def write(self, p: int, key: MetaKey, ident: int = NO_IDENT) -> None:
        """This rank's record for parity ``p`` (written before the step's counter), with
        ``ident`` saying whether the step also carries this rank's call identity."""
        cache = self._caches[ident]
        words = cache.get(key)
        if words is None:
            words = self._encode(key, ident)
            if len(cache) > 1024:
                cache.clear()
            cache[key] = words
        m = self._mine[p]
        self._q[m : m + RECORD_WORDS] = words

    @staticmethod
    def _encode(key: MetaKey, ident: int) -> memoryview:
        dims = [int(d) for d in key.shape[:MAX_DIMS]]
        rec = [key.coll_key | ident << IDENT_SHIFT, key.dtype, key.count, shape_hash(key.shape),
               key.root, key.in_loc, key.out_loc, len(key.shape)]
        rec += dims + [0] * (MAX_DIMS - len(dims))
        return memoryview(array.array("q", rec + [0] * (RECORD_WORDS - len(rec))))

    def field(self, i: int, p: int, f: int) -> int:
        """Word ``f`` of local rank ``i``'s record for parity ``p``."""
        return self._q[self._blk[i] + W_META[p] + f]

    def check(self, p: int, spans: tuple[tuple[int, int], ...], what: tuple) -> None:
        """Raise DDLMismatchError on every rank if any peer's record differs from ours in
        the given word spans. All ranks read the same records, so all raise together."""
        qb = self._qb
        off = W_META[p] * 8
        mine = self._mine[p] * 8
        for lo, hi in spans:
            ref = qb[mine + lo * 8 : mine + hi * 8]
            for b, _ in self._peer_bytes:
                if qb[b + off + lo * 8 : b + off + hi * 8] != ref:
                    raise self.error(p, what)

    def refused(self, p: int) -> bool:
        """Whether some rank's record of parity ``p`` is a refusal."""
        return any(self._q[b + W_META[p] + M_KEY] == coll_key(REFUSED) for b in self._blk)

    def error(self, p: int, what: tuple, mixed: bool = False) -> DDLMismatchError:
        """The error every rank raises for the records of parity ``p``: a refusal among
        them (``ShmEngine.refuse``), else some carrying a call identity and some not
        (``mixed``, or seen in their keys), else different arguments. ``refused`` tells the
        round across hosts to say so to the other hosts (identity_round.REFUSING)."""
        refused = self.refused(p)
        if refused:
            msg = (f"{self._me}: some ranks refused {what[0]} before its data moved (each "
                   "raises its own error, which says why); the others raise this:\n"
                   + self.lines(p))
        else:
            msg = self.mixed_report(p) if mixed else self.report(p, what)
        exc = DDLMismatchError(msg)
        exc.refused = refused
        return exc

    def report(self, p: int, what: tuple) -> str:
        q = self._q
        if len({q[b + W_META[p] + M_KEY] >> IDENT_SHIFT for b in self._blk}) > 1:
            return self.mixed_report(p)
        return (
            f"{self._me}: ranks called {what[0]} with different arguments "
            "(every rank must pass the same op, dtype and shape):\n" + self.lines(p)
        )

    def mixed_report(self, p: int) -> str:
        """Some ranks' step carries a call identity, others' does not."""
        return (
            f"{self._me}: some ranks run a Horovod-level call (hvd.*, which starts with an "
            "identity exchange), others a core ddl call (ddl.*) at the same point: use one "
            "API for the same collective on every rank:\n" + self.lines(p)
        )

    def lines(self, p: int) -> str:
        """Every rank's record of parity ``p``, one line each."""
        lines = []
        q = self._q
        for i in range(len(self._blk)):
            b = self._blk[i] + W_META[p]
            nd = q[b + M_NDIM]
            dims = [q[b + M_DIMS + k] for k in range(min(nd, MAX_DIMS))]
            shape = _show_dims(dims, nd)
            dt = BY_CODE.get(q[b + M_DTYPE])
            hvd = " (Horovod-level)" if q[b + M_KEY] >> IDENT_SHIFT else ""
            lines.append(
                f"  rank {self._grank[i]}: {describe_key(q[b + M_KEY])}{hvd} "
                f"{dt.name if dt else '-'}[{shape or 'scalar'}] root/extra={q[b + M_ROOT]}"
            )
        return "\n".join(lines)


def _show_dims(dims: list[int], nd: int) -> str:
    """A record's dimensions as a mismatch report shows them; a grouped allreduce's layout
    (``api.grouped_layout``: minus the tensor count, then each tensor's size) as
    ``100+200 in 2 tensors``."""
    more = nd > MAX_DIMS
    if dims and dims[0] < 0:
        sizes = "+".join(map(str, dims[1:])) + ("+..." if more else "")
        return f"{sizes} in {-dims[0]} tensors"
    return "x".join(map(str, dims)) + ("x..." if more else "")


# ------------------------------------------------------------------ call identities
# A Horovod-level call's identity (its descriptor, ddl.hvd.negotiate) rides on the first
# step of its data collective, or on a step of its own. Whether a rank's first step carries
# one is written in its metadata record's key word, above the collective and op: so the
# key comparison every collective makes anyway sees a rank that carries one against a rank
# that does not, and a plain core call pays nothing. The descriptor itself is one record per
# parity after the metadata records in the control block: its length, then its words
# (W_IDENT and the flags are defined at the top).


def check_identity(desc: np.ndarray) -> None:
    if desc.dtype != np.int64 or desc.ndim != 1 or desc.size > MAX_IDENT:
        raise DDLConfigError(f"a call identity is at most {MAX_IDENT} int64 words, got "
                             f"{desc.dtype}[{desc.shape}]")


class Unfolded(Exception):  # noqa: N818 - an outcome, not a failure
    """The first step carried this rank's call identity, but the data phase did not run in
    it: some rank exchanged its identity alone (a joined rank, a call that failed there),
    or the identities call for the error path. Every rank decided the same from the same
    records. ``result``: the elementwise MAX of every rank's descriptor."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)

    def __init__(self, result: np.ndarray):
        super().__init__("the call's data did not move in its first step")
        self.result = result


class Fold:
    """A descriptor to carry in the first step of the next collective, made once per kind
    of call and reused (so checked once, here): its owner patches the words that change
    between calls (``words``, the descriptor as int64s) before arming it again.
    ``stop(result)`` says whether the data phase must not run (the same answer on every
    rank: the same result). When every rank folded and the first ``same`` words of every
    descriptor are ours, the data moves at once (the caller vouches that ``stop`` would say
    no): nothing is computed."""

    __slots__ = ("words", "image", "stop", "same", "shape")

    def __init__(self, desc: np.ndarray, stop: Callable[[np.ndarray], bool], same: int = 0):
        check_identity(desc)
        if not 0 <= same <= desc.size:
            raise DDLConfigError(f"a fold compares at most its {desc.size} words, not {same}")
        # The record as it is written: its head word (length and flag), then the words.
        record = np.empty(desc.size + 1, dtype=np.int64)
        record[0] = head(desc.size, FOLDED)
        record[1:] = desc
        self.image = memoryview(record).cast("B").cast("q")
        self.words = self.image[1:]
        self.stop, self.same = stop, same
        self.shape = (desc.size + 1) << 16 | same  # the views it needs (Identities.span)


def head(size: int, flag: int) -> int:
    """An identity record's first word: the descriptor's length, and how it travels (so
    one comparison of the records also compares the flags)."""
    return size | flag << 32


class Identities:
    """Read and write the identity records of every local rank.

    ``q``/``qb``: the control segment as int64 words and as bytes; ``words``: the same
    words as a numpy array; ``blocks``: the first word of each rank's control block,
    ``stride`` words apart. A record is its head word (see :func:`head`), then the words."""

    def __init__(self, q: memoryview, qb: memoryview, words: np.ndarray, blocks: list[int],
                 rank: int, stride: int):
        self._q, self._qb = q, qb
        n = len(blocks)
        rows = words[blocks[0] : blocks[0] + n * stride].reshape(n, stride)
        self._rows = [rows[:, w + 1 : w + IDENT_WORDS] for w in W_IDENT]
        self._mine = [blocks[rank] + w for w in W_IDENT]
        self._mine_rows = [r[rank] for r in self._rows]
        self._keys = [[b + w + M_KEY for b in blocks] for w in W_META]
        self._heads = [[b + w for b in blocks] for w in W_IDENT]
        self._peers = [[b + w for i, b in enumerate(blocks) if i != rank] for w in W_IDENT]
        # per parity: words compared -> (our record's first words, each peer's), as views
        self._spans: list[dict[int, tuple[memoryview, list[memoryview]]]] = [{}, {}]

    def write(self, p: int, desc: np.ndarray, flag: int) -> None:
        """This rank's descriptor for parity ``p``, travelling as ``flag``."""
        self._mine_rows[p][: desc.size] = desc
        self._q[self._mine[p]] = head(desc.size, flag)

    def span(self, p: int, fold: Fold) -> tuple[memoryview, memoryview, list[memoryview]]:
        """Views for ``fold`` at parity ``p`` (made once per shape of fold): where its image
        goes (this rank's record), and the words compared to tell that every rank folded the same
        call, ours and each peer's. The engine writes and compares through them itself: the
        hot path."""
        span = self._spans[p].get(fold.shape)
        if span is None:
            q, at, end = self._q, self._mine[p], fold.same + 1
            span = self._spans[p][fold.shape] = (
                q[at : at + len(fold.image)], q[at : at + end],
                [q[b : b + end] for b in self._peers[p]])
        return span

    def flags(self, p: int) -> list[int]:
        """Every rank's identity flag at parity ``p`` (from its metadata record)."""
        q = self._q
        return [q[w] >> IDENT_SHIFT for w in self._keys[p]]

    def lengths_agree(self, p: int) -> bool:
        q = self._q
        return len({q[w] & _LENGTH for w in self._heads[p]}) == 1

    def result(self, p: int) -> np.ndarray:
        """The elementwise MAX of every rank's descriptor (the same on every rank)."""
        n = self._q[self._mine[p]] & _LENGTH
        return np.maximum.reduce(self._rows[p][:, :n], axis=0)

    def close(self) -> None:
        for spans in self._spans:
            for record, mine, peers in spans.values():
                for view in (record, mine, *peers):
                    view.release()
            spans.clear()
        self._rows = self._mine_rows = []
        self._q = self._qb = None


_LENGTH = (1 << 32) - 1  # the head word's length bits
