"""The store's server: one thread on rank 0 serving every rank's connection.

It binds the one address the job uses (``MASTER_ADDR``), never the wildcard; with a secret,
a connection is served only after it proves the secret (``wire``'s handshake), and the
server proves it back. Every wait is bounded: a get or wait parks its connection until a
write completes it or its timeout passes; a handshake may take ``HANDSHAKE_TIMEOUT`` at
most, and only ``MAX_PENDING`` connections may be in theirs at once (the oldest silent one
is cut off for a newcomer); a wrong proof is hung up on after ``REFUSE_DELAY``. So a client
that connects and says nothing (or many of them) cannot hold the job up.
"""

from __future__ import annotations

import errno
import heapq
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time

from ..errors import DDLConfigError
from .wire import (
    CLIENT_LABEL,
    FLAG_GENERATION,
    FLAG_SECRET,
    GEN,
    HANDSHAKE_TIMEOUT,
    HEAD,
    HELLO,
    I64,
    MAGIC,
    MAX_FRAME,
    NO_PROOF,
    NONCE,
    SERVER_LABEL,
    Closed,
    Op,
    Status,
    frame,
    proof,
    split_fields,
)

log = logging.getLogger("ddl")

MAX_PENDING = 64  # connections allowed to be in their handshake at once
REFUSE_DELAY = 0.2  # seconds before a wrong proof is hung up on: slows guessing down
_ACCEPT_BATCH = 16  # connections accepted per round of the server's loop


class PortInUse(DDLConfigError):
    """Rank 0 cannot bind the rendezvous: another process (another job?) holds the port."""


def _listen(addr: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise DDLConfigError(
            f"rank 0: cannot resolve MASTER_ADDR={addr!r} for ddl's rendezvous ({exc.strerror}): "
            "set MASTER_ADDR to this host's address"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)  # every rank connects at once at init
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"rank 0: ddl's rendezvous cannot listen: port {port} on {addr} is in use "
                "(another job? set MASTER_PORT or DDL_PORT)"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise DDLConfigError(
                f"rank 0: ddl's rendezvous cannot listen on {addr}:{port}: {sockaddr[0]} is not "
                "an address of this host (rank 0 must run on MASTER_ADDR)"
            ) from None
        raise DDLConfigError(
            f"rank 0: ddl's rendezvous cannot listen on {addr}:{port} ({exc.strerror})"
        ) from None
    return sock


def _has_data(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:
        return False


class _Conn:
    """One connection's state in the server's loop."""

    __slots__ = ("sock", "state", "nonce", "rbuf", "wbuf", "parked", "dead")

    def __init__(self, sock: socket.socket, state: str, nonce: bytes):
        self.sock = sock
        self.state = state  # "proof" (handshake), "ready", "refused"
        self.nonce = nonce
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.parked: _Parked | None = None  # a get or wait that is waiting for keys
        self.dead = False


class _Parked:
    __slots__ = ("op", "keys", "deadline")

    def __init__(self, op: Op, keys: list[str], deadline: float):
        self.op = op
        self.keys = keys
        self.deadline = deadline


class StoreServer:
    """The store, served from rank 0 on ``addr:port`` (port 0: any free port, see ``.port``).

    ``generation``: which ``ddl.init()`` of the job this store serves. After a shutdown the
    next init's store takes the same port, and a rank may get there before rank 0 closed
    the last one: the hello names the generation (and the server's proof covers it), so
    that rank waits for the new store instead of joining the old one and its stale keys.

    One daemon thread serves every connection from one ``selectors`` loop: a blocked get or
    wait parks its connection until a write completes it or its timeout passes, so rank 0
    keeps one thread however many ranks connect (and none is left to a stranger who
    connects and says nothing). ``secret=None`` runs open."""

    def __init__(self, addr: str, port: int, secret: bytes | None, *, timeout: float,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, max_pending: int = MAX_PENDING,
                 generation: int | None = None):
        self.addr = addr
        self._secret = secret
        self.generation = generation
        self._gen = b"" if generation is None else GEN.pack(generation)
        self._handshake_timeout = min(handshake_timeout, max(timeout, 0.1))
        self._max_pending = max_pending
        self._data: dict[str, bytes] = {}
        self._conns: set[_Conn] = set()
        self._pending: dict[_Conn, None] = {}  # in their handshake, oldest first
        self._refused: dict[_Conn, None] = {}  # waiting out REFUSE_DELAY
        self._waiters: dict[str, set[_Conn]] = {}  # key -> parked connections that need it
        self._timers: list[tuple[float, int, str, _Conn]] = []  # heap; stale entries skipped
        self._seq = 0
        self._closed = False
        self._sock = _listen(addr, port)
        self.port: int = self._sock.getsockname()[1]
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"ddl-store-{self.port}")
        self._thread.start()

    def close(self, join_timeout: float = 2.0) -> None:
        """Stop serving: every call answered so far has its reply; every call in flight
        and every later one fails with DDLPeerError."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(join_timeout)

    # ------------------------------------------------------------------- loop
    def _loop(self) -> None:
        try:
            while not self._closed:
                timeout = None
                if self._timers:
                    timeout = max(0.0, self._timers[0][0] - time.monotonic())
                for key, mask in self._sel.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        self._event(key.data, mask)
                self._expire()
        except Exception:  # pragma: no cover - a bug here must not pass as a silent hang
            log.exception("ddl: the rendezvous server on port %d failed", self.port)
            raise
        finally:
            self._teardown()

    def _event(self, conn: _Conn, mask: int) -> None:
        if conn.dead:  # dropped earlier in this round of events
            return
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ and not conn.dead:
                data = conn.sock.recv(1 << 16)
                if not data:
                    self._drop(conn)
                    return
                conn.rbuf += data
                self._advance(conn)
        except (OSError, Closed, struct.error):
            self._drop(conn)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass

    def _timer(self, when: float, kind: str, conn: _Conn) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, kind, conn))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            when, _, kind, conn = heapq.heappop(self._timers)
            if conn.dead:
                continue
            if kind == "refuse":
                try:
                    conn.sock.send(NO_PROOF)  # 32 bytes into an empty buffer: never blocks
                except OSError:
                    pass
                self._drop(conn)
            elif kind == "handshake" and conn.state == "proof":
                self._drop(conn)
            elif kind == "wait" and conn.parked is not None and conn.parked.deadline == when:
                parked = self._unpark(conn)
                missing = [k for k in parked.keys if k not in self._data]
                self._reply(conn, Status.TIMEOUT, [k.encode() for k in missing])
                self._resume(conn)

    def _teardown(self) -> None:
        for conn in list(self._conns):
            if conn.wbuf:  # replies already made: one last try to hand them over
                try:
                    conn.sock.send(conn.wbuf)
                except OSError:
                    pass
            self._drop(conn)
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()

    # ------------------------------------------------------------ connections
    def _accept(self) -> None:
        # A bounded batch per round of events: under a flood of connections the backlog
        # never empties, and the ranks' requests on open connections must still be served.
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError:  # EMFILE and the like: make room rather than spin
                if self._pending:
                    self._drop(next(iter(self._pending)))
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.urandom(NONCE)
            conn = _Conn(sock, "proof" if self._secret else "ready", nonce)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            if self._secret:
                if len(self._pending) >= self._max_pending:
                    # Evict instead of refusing the newcomer: a flood of silent connections
                    # then cannot lock a rank out, whose own handshake takes one round trip
                    # (and which tries again if it was the one cut off: its deadline, not
                    # the flood, decides).
                    self._drop(self._evictable())
                self._pending[conn] = None
                self._timer(time.monotonic() + self._handshake_timeout, "handshake", conn)
            flags = (FLAG_SECRET if self._secret else 0) | (FLAG_GENERATION if self._gen else 0)
            self._send(conn, HELLO.pack(MAGIC, flags, nonce) + self._gen)

    def _evictable(self) -> _Conn:
        """The oldest connection in its handshake that has sent nothing: one whose proof
        is already here is answered in this round of events, so a rank that answered in
        time is never the one cut off."""
        for conn in self._pending:
            if not conn.rbuf and not _has_data(conn.sock):
                return conn
        return next(iter(self._pending))

    def _drop(self, conn: _Conn) -> None:
        if conn.dead:
            return
        conn.dead = True
        if conn.parked is not None:
            self._unpark(conn)
        self._pending.pop(conn, None)
        self._refused.pop(conn, None)
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass  # a refused connection is no longer registered
        conn.sock.close()

    def _send(self, conn: _Conn, data: bytes) -> None:
        """Never raises: a connection that cannot take its reply is dropped."""
        if conn.dead:
            return
        if not conn.wbuf:
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._drop(conn)
                return
            data = data[sent:]
            if not data:
                return
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        conn.wbuf += data

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.wbuf)
        except BlockingIOError:
            return
        del conn.wbuf[:sent]
        if not conn.wbuf:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def _advance(self, conn: _Conn) -> None:
        """Consume what ``conn`` has sent, as far as its state allows."""
        while not conn.dead and conn.parked is None:
            if conn.state == "proof":
                if len(conn.rbuf) < 2 * NONCE:
                    return
                answer = bytes(conn.rbuf[:2 * NONCE])
                del conn.rbuf[:2 * NONCE]
                if not hmac.compare_digest(answer[:NONCE],
                                           proof(self._secret, CLIENT_LABEL, conn.nonce)):
                    self._refuse(conn)
                    return
                del self._pending[conn]
                conn.state = "ready"
                self._send(conn, proof(self._secret, SERVER_LABEL, answer[NONCE:] + self._gen))
                continue
            if len(conn.rbuf) < HEAD.size:
                return
            op, size = HEAD.unpack_from(conn.rbuf)
            if size > MAX_FRAME:
                raise Closed()
            if len(conn.rbuf) < HEAD.size + size:
                return
            body = bytes(conn.rbuf[HEAD.size:HEAD.size + size])
            del conn.rbuf[:HEAD.size + size]
            self._command(conn, op, split_fields(body))

    def _refuse(self, conn: _Conn) -> None:
        """Hang up on a wrong proof, after a delay that slows guessing down; never read
        from it again. Past the cap, at once: delays must not pile up descriptors."""
        self._pending.pop(conn, None)
        if len(self._refused) >= self._max_pending:
            self._drop(conn)
            return
        conn.state = "refused"
        conn.rbuf.clear()
        self._sel.unregister(conn.sock)
        self._refused[conn] = None
        self._timer(time.monotonic() + REFUSE_DELAY, "refuse", conn)

    # --------------------------------------------------------------- commands
    def _reply(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        self._send(conn, frame(code, fields))

    def _command(self, conn: _Conn, op: int, f: list[bytes]) -> None:
        try:
            code, fields = self._run(conn, Op(op), f)
        except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
            code, fields = Status.ERROR, [str(exc).encode()]
        if code is not None:
            self._reply(conn, code, fields)

    def _run(self, conn: _Conn, op: Op, f: list[bytes]) -> tuple[int | None, list[bytes]]:
        """The reply to ``op``, or (None, []) when it parked ``conn`` until keys exist."""
        ok = Status.OK
        if op is Op.SET:
            self._put(f[0].decode(), f[1])
            return ok, []
        if op is Op.GET:
            key = f[0].decode()
            if key in self._data:
                return ok, [self._data[key]]
            self._park(conn, Op.GET, [key], I64.unpack(f[1])[0] / 1000)
            return None, []
        if op is Op.ADD:
            key = f[0].decode()
            value = int(self._data.get(key, b"0")) + I64.unpack(f[1])[0]
            self._put(key, str(value).encode())
            return ok, [I64.pack(value)]
        if op is Op.COMPARE_SET:
            key, expected, desired = f[0].decode(), f[1], f[2]
            current = self._data.get(key)
            if current is None and expected != b"":
                return ok, [expected]  # torch's answer for a missing key
            if current is None or current == expected:
                self._put(key, desired)
                return ok, [desired]
            return ok, [current]
        if op is Op.CHECK:
            return ok, [b"\x01" if all(k.decode() in self._data for k in f) else b"\x00"]
        if op is Op.WAIT:
            keys = [k.decode() for k in f[1:]]
            if all(k in self._data for k in keys):
                return ok, []
            self._park(conn, Op.WAIT, keys, I64.unpack(f[0])[0] / 1000)
            return None, []
        if op is Op.DELETE:
            return ok, [b"\x01" if self._data.pop(f[0].decode(), None) is not None else b"\x00"]
        if op is Op.NUM_KEYS:
            return ok, [I64.pack(len(self._data))]
        raise ValueError(f"unknown op {op}")  # pragma: no cover - Op() already refused it

    def _put(self, key: str, value: bytes) -> None:
        self._data[key] = value
        for conn in list(self._waiters.pop(key, ())):
            parked = conn.parked
            if conn.dead or parked is None or not all(k in self._data for k in parked.keys):
                continue
            self._unpark(conn)
            if parked.op is Op.GET:
                self._reply(conn, Status.OK, [self._data[parked.keys[0]]])
            else:
                self._reply(conn, Status.OK, [])
            self._resume(conn)

    def _resume(self, conn: _Conn) -> None:
        """``_advance`` for a connection other than the one being served: its faults are
        its own."""
        try:
            self._advance(conn)
        except (OSError, Closed, struct.error):
            self._drop(conn)

    def _park(self, conn: _Conn, op: Op, keys: list[str], timeout: float) -> None:
        conn.parked = _Parked(op, keys, time.monotonic() + timeout)
        for k in keys:
            if k not in self._data:
                self._waiters.setdefault(k, set()).add(conn)
        self._timer(conn.parked.deadline, "wait", conn)

    def _unpark(self, conn: _Conn) -> _Parked:
        parked, conn.parked = conn.parked, None
        for k in parked.keys:
            waiting = self._waiters.get(k)
            if waiting is not None:
                waiting.discard(conn)
                if not waiting:
                    del self._waiters[k]
        return parked
