"""The chunked walk of the shared-memory engine's reduce-scatter, and of the allgather an
allreduce runs as it goes: where every peer's input and output live, and what one rank
moves in one chunk.

Rank ``i`` owns the elements ``[starts[i], starts[i] + counts[i])`` and reduces them; chunk
``t`` covers elements ``[t * share, (t + 1) * share)`` of every rank's part. A staging slot
holds, for one chunk, ``share`` elements of every part (the inputs their reducers read)
and then ``share`` elements of its own rank's reduced part (what the others collect).

A peer's input is read from one of three places, one helper each: its heap (a buffer from
``ddl.malloc``, read in place), its private memory (a cross-memory copy, engines/cma.py),
or its staging slot. Its output likewise is written in its heap, in its private memory,
or collected by the peer from our slot. The steps around these moves are shm.py's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..dtypes import DType
from ..errors import DDLPeerError
from ..ops import ReduceOp, reduce_into
from ..tensors import Pieces
from .cma import CrossMemory
from .shm_sync import pid_alive


def parts(src: np.ndarray | Pieces, lo: int, hi: int) -> list:
    """``(lo, hi, view)`` for elements ``[lo, hi)`` of ``src``, cut where its pieces end."""
    if isinstance(src, Pieces):
        return src.cuts(lo, hi)
    return [(lo, hi, src[lo:hi])]


def read(src: np.ndarray | Pieces, lo: int, hi: int, out: np.ndarray) -> None:
    """Copy elements ``[lo, hi)`` of ``src`` into ``out``."""
    if isinstance(src, Pieces):
        src.copy_to(lo, hi, out)
    else:
        np.copyto(out, src[lo:hi])


def write(dst: np.ndarray | Pieces, lo: int, hi: int, data: np.ndarray) -> None:
    """Copy ``data`` into elements ``[lo, hi)`` of ``dst``."""
    if isinstance(dst, Pieces):
        dst.copy_from(lo, hi, data)
    else:
        np.copyto(dst[lo:hi], data)


def stage_inputs(src: np.ndarray | Pieces, slot: np.ndarray, rank: int, peers: list[int],
                 chunk: int, share: int, counts: list[int], starts: list[int],
                 dt: DType) -> None:
    """Copy chunk ``chunk`` of every part but ours (``rank``'s) into our ``slot``, where
    its reducer reads it (``ChunkPlan._read_staged``)."""
    first = chunk * share
    isz = dt.itemsize
    for j in peers:
        length = min(counts[j] - first, share)
        if length > 0:
            read(src, starts[j] + first, starts[j] + first + length,
                 slot[j * share * isz : (j * share + length) * isz].view(dt.storage))


class ChunkPlan(NamedTuple):
    """How this rank walks one reduce-scatter, once the first step's records told where
    every peer's data lives. Lists are indexed by local rank (None: not there)."""

    share: int
    chunks: int  # chunks of the largest part
    counts: list[int]
    starts: list[int]
    in_views: list  # peer i's input read in place from its heap
    out_views: list  # peer i's output written in place in its heap
    publish: bool  # some rank collects our reduced part from our slot
    block: int  # elements reduced, then passed on, at a time: while they are in cache
    in_remote: list  # (pid, address) of peer i's private input, read by cross-memory copy
    out_remote: list  # (pid, address) of peer i's private output, written likewise
    scratch: list | None  # one block per peer: what was read from its private input
    read_in_place: bool  # some rank's input is read where it lives, not from its slot
    rank: int
    size: int
    peers: list[int]
    xmem: CrossMemory | None
    me: str  # "rank <global rank>", for the messages
    granks: dict[int, int]  # each local rank's job rank and pid (for the messages)
    pids: dict[int, int]

    def reduce(self, src: np.ndarray | Pieces, dst: np.ndarray | Pieces, slots: list,
               result_area: np.ndarray, chunk: int, dt: DType, op: ReduceOp,
               gather: bool) -> None:
        """Reduce our part of chunk ``chunk`` in cache-sized blocks and pass each block on
        while it is hot: into ``result_area`` (our slot of the next parity, read by the
        peers at the next step) and into the peers' outputs. ``slots``: every rank's slot
        of this chunk's parity."""
        share, isz = self.share, dt.itemsize
        first = chunk * share
        length = min(self.counts[self.rank] - first, share)
        base = self.starts[self.rank] + first  # the element at offset 0 of our part of the chunk
        results = self.size * share  # where a slot's result area starts, in elements
        for block_start in range(0, max(length, 0), self.block):
            block_end = base + min(block_start + self.block, length)
            for lo, hi, mine in parts(src, base + block_start, block_end):
                offset = lo - base  # inside our part of the chunk
                terms = [mine]
                for i in self.peers:
                    terms.append(self._peer_input(i, slots[i], lo, hi, offset, dt, gather))
                if dst is src:
                    out = mine
                elif gather:
                    out = dst[lo:hi]
                else:
                    out = dst[first + offset : first + offset + hi - lo]
                reduce_into(out, terms, op, dt, self.size)
                if self.publish:
                    at = (results + offset) * isz
                    np.copyto(result_area[at : at + (hi - lo) * isz].view(dt.storage), out)
                if gather:
                    self._pass_on(out, lo, hi, dt)

    def _peer_input(self, i: int, slot: np.ndarray, lo: int, hi: int, offset: int,
                    dt: DType, gather: bool) -> np.ndarray:
        """Elements ``[lo, hi)`` of local rank ``i``'s input (``offset`` into our part of
        the chunk), from where it lives: its heap, its private memory, or its ``slot``."""
        view = self.in_views[i]
        if view is not None:
            return view[lo:hi]  # in its heap: read in place
        if self.in_remote[i] is not None:
            return self._read_private(i, lo, hi, dt, gather)
        return self._read_staged(slot, offset, hi - lo, dt)

    def _read_private(self, i: int, lo: int, hi: int, dt: DType, gather: bool) -> np.ndarray:
        """Elements ``[lo, hi)`` of local rank ``i``'s private input, copied across address
        spaces into its scratch block."""
        pid, addr = self.in_remote[i]
        got = self.scratch[i][: hi - lo]
        try:
            self.xmem.read(pid, addr + lo * dt.itemsize, got)
        except DDLPeerError as exc:
            raise self._lost(i, exc, gather) from None
        return got

    def _read_staged(self, slot: np.ndarray, offset: int, count: int, dt: DType) -> np.ndarray:
        """``count`` elements of our part, from ``offset`` on, where a peer staged them in
        its ``slot`` (``stage_inputs``)."""
        at = (self.rank * self.share + offset) * dt.itemsize
        return slot[at : at + count * dt.itemsize].view(dt.storage)

    def _pass_on(self, out: np.ndarray, lo: int, hi: int, dt: DType) -> None:
        """Write the reduced elements ``[lo, hi)`` into the output of every peer that does
        not collect them from our slot: in its heap, or in its private memory."""
        for j in self.peers:
            view = self.out_views[j]
            if view is not None:
                np.copyto(view[lo:hi], out)
            elif self.out_remote[j] is not None:
                pid, addr = self.out_remote[j]
                try:
                    self.xmem.write(pid, addr + lo * dt.itemsize, out)
                except DDLPeerError as exc:
                    raise self._lost(j, exc, True) from None

    def collect(self, dst: np.ndarray | Pieces, slots: list, chunk: int, dt: DType) -> None:
        """Copy the peers' reduced parts of chunk ``chunk`` from their ``slots`` (of the
        parity they published them in) into ``dst``."""
        first = chunk * self.share
        results = self.size * self.share * dt.itemsize  # where a slot's result area starts
        for j in self.peers:
            length = min(self.counts[j] - first, self.share)
            if length > 0:
                part = slots[j][results : results + length * dt.itemsize]
                write(dst, self.starts[j] + first, self.starts[j] + first + length,
                      part.view(dt.storage))

    def _lost(self, i: int, exc: DDLPeerError, gather: bool) -> DDLPeerError:
        """A cross-memory copy with local rank ``i`` failed: it died (or its memory went)
        inside the collective."""
        what = "allreduce" if gather else "reduce_scatter"
        alive = "" if pid_alive(self.pids[i]) else " died;"
        return DDLPeerError(f"{self.me}: {what}: rank {self.granks[i]}{alive} {exc}")
