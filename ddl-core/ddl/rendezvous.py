"""ddl's own rendezvous: a small TCP key-value store on rank 0 that only the job can use.

torch's ``TCPStore`` listens on every interface and serves anyone who connects, so another
user of the host (or any host that reaches host 0) could read the job's keys and redirect
its Gloo connections. This store instead

- binds the one address the job uses (``MASTER_ADDR``), never the wildcard;
- serves a connection only after a mutual challenge/response over the job's secret
  (``DDL_JOB_SECRET``): the server sends a nonce, the client proves the secret with
  HMAC-SHA256 over it and sends its own nonce, and the server proves the secret back, so a
  process squatting on the port cannot feed the job keys either;
- bounds every wait, and keeps a client that connects and says nothing (or many of them)
  from holding the job up.

Without a secret the store runs open, as torch's does, and rank 0 says so once.
The Gloo/NCCL data connections that groups open after meeting here are not authenticated
(as in torch); only what goes through this store is.

Wire format, after the handshake: every request and reply is one frame, ``!BI`` (op or
status, body length) then the body, a sequence of ``!I``-length-prefixed fields.
Keys are UTF-8 text, values bytes; ``add`` keeps its counter as decimal text, as torch does.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import heapq
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence

from .errors import DDLConfigError, DDLError, DDLPeerError, DDLTimeoutError

log = logging.getLogger("ddl")

HANDSHAKE_TIMEOUT = 10.0  # seconds a connection may take to prove the secret
MAX_PENDING = 64  # connections allowed to be in their handshake at once
REFUSE_DELAY = 0.2  # seconds before a wrong proof is hung up on: slows guessing down
_ACCEPT_BATCH = 16  # connections accepted per round of the server's loop
_REPLY_SLACK = 5.0  # how much longer than a blocking wait the client waits for the reply
_MAX_FRAME = 1 << 30

_MAGIC = b"DDLS1"
_HELLO = struct.Struct("!5sB32s")  # magic, flags, server nonce
_FLAG_SECRET = 1
_FLAG_GENERATION = 2  # a !I generation follows the hello (a server of ddl.init's)
_GEN = struct.Struct("!I")
_NONCE = 32
# What a wrong proof gets back (after REFUSE_DELAY) instead of the server's proof: a
# constant that tells nothing, but tells a refused client apart from one whose handshake
# was cut off (evicted by a flood of strangers), which hears nothing and tries again.
_NO_PROOF = bytes(_NONCE)
_CLIENT_LABEL = b"ddl-store-client"
_SERVER_LABEL = b"ddl-store-server"
_HEAD = struct.Struct("!BI")
_LEN = struct.Struct("!I")
_I64 = struct.Struct("!q")


class _Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    CHECK = 5
    WAIT = 6
    DELETE = 7
    NUM_KEYS = 8


class _Status(enum.IntEnum):
    OK = 0
    TIMEOUT = 1  # fields: the keys still missing
    ERROR = 2  # field: a message


class PortInUse(DDLConfigError):
    """Rank 0 cannot bind the rendezvous: another process (another job?) holds the port."""


class _Closed(Exception):
    """The other end went away (or the frame was not ours)."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)


# ------------------------------------------------------------------------- framing
def _frame(code: int, fields: Iterable[bytes]) -> bytes:
    parts = []
    for f in fields:
        parts.append(_LEN.pack(len(f)))
        parts.append(f)
    body = b"".join(parts)
    return _HEAD.pack(code, len(body)) + body


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handshake deadline")
            sock.settimeout(left)  # per read, so a client trickling bytes still runs out
        k = sock.recv_into(view[got:])
        if k == 0:
            raise _Closed()
        got += k
    return bytes(buf)


def _fields(body: bytes) -> list[bytes]:
    fields, at, size = [], 0, len(body)
    while at < size:
        if at + _LEN.size > size:
            raise _Closed()
        (k,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        if at + k > size:
            raise _Closed()
        fields.append(body[at:at + k])
        at += k
    return fields


def _recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    code, size = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if size > _MAX_FRAME:
        raise _Closed()
    return code, _fields(_recv_exact(sock, size) if size else b"")


def _proof(secret: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, label + nonce, hashlib.sha256).digest()


def _shutdown(sock: socket.socket) -> None:
    """Wake whoever is blocked on ``sock`` (close alone does not, on Linux)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _ms(seconds: float) -> bytes:
    return _I64.pack(max(0, int(seconds * 1000)))


# -------------------------------------------------------------------------- server
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

    def __init__(self, op: _Op, keys: list[str], deadline: float):
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
        self._gen = b"" if generation is None else _GEN.pack(generation)
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
        except (OSError, _Closed, struct.error):
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
                    conn.sock.send(_NO_PROOF)  # 32 bytes into an empty buffer: never blocks
                except OSError:
                    pass
                self._drop(conn)
            elif kind == "handshake" and conn.state == "proof":
                self._drop(conn)
            elif kind == "wait" and conn.parked is not None and conn.parked.deadline == when:
                parked = self._unpark(conn)
                missing = [k for k in parked.keys if k not in self._data]
                self._reply(conn, _Status.TIMEOUT, [k.encode() for k in missing])
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
            nonce = os.urandom(_NONCE)
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
            flags = (_FLAG_SECRET if self._secret else 0) | (_FLAG_GENERATION if self._gen else 0)
            self._send(conn, _HELLO.pack(_MAGIC, flags, nonce) + self._gen)

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
                if len(conn.rbuf) < 2 * _NONCE:
                    return
                answer = bytes(conn.rbuf[:2 * _NONCE])
                del conn.rbuf[:2 * _NONCE]
                if not hmac.compare_digest(answer[:_NONCE],
                                           _proof(self._secret, _CLIENT_LABEL, conn.nonce)):
                    self._refuse(conn)
                    return
                del self._pending[conn]
                conn.state = "ready"
                self._send(conn, _proof(self._secret, _SERVER_LABEL, answer[_NONCE:] + self._gen))
                continue
            if len(conn.rbuf) < _HEAD.size:
                return
            op, size = _HEAD.unpack_from(conn.rbuf)
            if size > _MAX_FRAME:
                raise _Closed()
            if len(conn.rbuf) < _HEAD.size + size:
                return
            body = bytes(conn.rbuf[_HEAD.size:_HEAD.size + size])
            del conn.rbuf[:_HEAD.size + size]
            self._command(conn, op, _fields(body))

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
        self._send(conn, _frame(code, fields))

    def _command(self, conn: _Conn, op: int, f: list[bytes]) -> None:
        try:
            code, fields = self._run(conn, _Op(op), f)
        except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
            code, fields = _Status.ERROR, [str(exc).encode()]
        if code is not None:
            self._reply(conn, code, fields)

    def _run(self, conn: _Conn, op: _Op, f: list[bytes]) -> tuple[int | None, list[bytes]]:
        """The reply to ``op``, or (None, []) when it parked ``conn`` until keys exist."""
        ok = _Status.OK
        if op is _Op.SET:
            self._put(f[0].decode(), f[1])
            return ok, []
        if op is _Op.GET:
            key = f[0].decode()
            if key in self._data:
                return ok, [self._data[key]]
            self._park(conn, _Op.GET, [key], _I64.unpack(f[1])[0] / 1000)
            return None, []
        if op is _Op.ADD:
            key = f[0].decode()
            value = int(self._data.get(key, b"0")) + _I64.unpack(f[1])[0]
            self._put(key, str(value).encode())
            return ok, [_I64.pack(value)]
        if op is _Op.COMPARE_SET:
            key, expected, desired = f[0].decode(), f[1], f[2]
            current = self._data.get(key)
            if current is None and expected != b"":
                return ok, [expected]  # torch's answer for a missing key
            if current is None or current == expected:
                self._put(key, desired)
                return ok, [desired]
            return ok, [current]
        if op is _Op.CHECK:
            return ok, [b"\x01" if all(k.decode() in self._data for k in f) else b"\x00"]
        if op is _Op.WAIT:
            keys = [k.decode() for k in f[1:]]
            if all(k in self._data for k in keys):
                return ok, []
            self._park(conn, _Op.WAIT, keys, _I64.unpack(f[0])[0] / 1000)
            return None, []
        if op is _Op.DELETE:
            return ok, [b"\x01" if self._data.pop(f[0].decode(), None) is not None else b"\x00"]
        if op is _Op.NUM_KEYS:
            return ok, [_I64.pack(len(self._data))]
        raise ValueError(f"unknown op {op}")  # pragma: no cover - _Op() already refused it

    def _put(self, key: str, value: bytes) -> None:
        self._data[key] = value
        for conn in list(self._waiters.pop(key, ())):
            parked = conn.parked
            if conn.dead or parked is None or not all(k in self._data for k in parked.keys):
                continue
            self._unpark(conn)
            if parked.op is _Op.GET:
                self._reply(conn, _Status.OK, [self._data[parked.keys[0]]])
            else:
                self._reply(conn, _Status.OK, [])
            self._resume(conn)

    def _resume(self, conn: _Conn) -> None:
        """``_advance`` for a connection other than the one being served: its faults are
        its own."""
        try:
            self._advance(conn)
        except (OSError, _Closed, struct.error):
            self._drop(conn)

    def _park(self, conn: _Conn, op: _Op, keys: list[str], timeout: float) -> None:
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


# -------------------------------------------------------------------------- client
class StoreClient:
    """A connection to the store for one rank. Thread-safe: each call takes a connection
    from a pool (opening one when all are busy), so a thread blocked in ``get`` never holds
    up another thread's ``set`` that would end its wait.

    ``generation``: the store of which ``ddl.init()`` to join (see StoreServer); None takes
    whichever serves the port."""

    def __init__(self, addr: str, port: int, secret: bytes | None, *, rank: int,
                 timeout: float, generation: int | None = None):
        self.addr = addr
        self.port = port
        self.rank = rank
        self.timeout = timeout
        self.generation = generation
        self._secret = secret
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._all: set[socket.socket] = set()
        self._closed = False
        self._lost = False  # the server was reached once and has gone since
        self._reached = False
        self._idle.append(self._open(time.monotonic() + timeout, "connect"))
        self._reached = True

    @property
    def _where(self) -> str:
        return f"{self.addr}:{self.port}"

    def _lost_error(self, what: str) -> DDLPeerError:
        self._lost = True
        return DDLPeerError(f"rank {self.rank}: {what}: lost ddl's rendezvous at {self._where} "
                            "(rank 0 gone?)")

    # ------------------------------------------------------------ connections
    def _open(self, deadline: float, what: str) -> socket.socket:
        """A connection that passed the handshake; retries until ``deadline`` while rank 0's
        server is not up yet (or evicted us under a flood of strangers)."""
        delay, cut, last = 0.01, 0, "no attempt"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DDLTimeoutError(
                    f"rank {self.rank}: cannot reach ddl's rendezvous at {self._where} within "
                    f"{self.timeout:g}s ({last}): is rank 0 up, and does MASTER_ADDR name an "
                    "address of host 0 that this host reaches? (ddlrun --network-interface "
                    "picks it; a name /etc/hosts maps to 127.0.1.1 on host 0 is loopback only)"
                )
            try:
                sock = socket.create_connection((self.addr, self.port),
                                                timeout=min(left, HANDSHAKE_TIMEOUT))
            except OSError as exc:
                if self._reached and isinstance(exc, ConnectionRefusedError):
                    raise self._lost_error(what) from None  # it was up: now it is gone
                last = exc.strerror or str(exc)
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._handshake(sock, min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT))
            except _OtherGeneration as other:
                sock.close()
                if self._reached:  # ours closed, and the next init's took the port
                    raise self._lost_error(what) from None
                if other.found is not None and other.found > self.generation:
                    raise DDLPeerError(
                        f"rank {self.rank}: ddl's rendezvous at {self._where} serves init "
                        f"#{other.found} of the job, this rank is at init #{self.generation} "
                        "(did the ranks call ddl.init() unequally often?)"
                    ) from None
                # rank 0 has not closed the last init's store yet: wait for the new one
                last = (f"rank 0 still serves the store of init #{other.found}, this rank "
                        f"wants init #{self.generation}")
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            except _CutOff:
                sock.close()
                cut += 1
                last = (f"the rendezvous cut this rank's handshake off {cut} time(s) before "
                        "answering: is another process flooding the port with connections?")
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            except (OSError, _Closed) as exc:
                sock.close()
                last = f"handshake failed: {exc or 'closed'}"
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            except BaseException:
                sock.close()
                raise
            with self._lock:
                if self._closed:
                    sock.close()
                    raise DDLError(f"rank {self.rank}: ddl's rendezvous client is closed")
                self._all.add(sock)
            return sock

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        try:
            magic, flags, nonce = _HELLO.unpack(_recv_exact(sock, _HELLO.size, deadline))
        except TimeoutError:
            raise DDLConfigError(
                f"rank {self.rank}: {self._where} did not greet as ddl's rendezvous does: "
                "another program holds the port (set MASTER_PORT or DDL_PORT)"
            ) from None
        if magic != _MAGIC:
            raise DDLConfigError(
                f"rank {self.rank}: {self._where} is not ddl's rendezvous (another program "
                "holds the port? set MASTER_PORT or DDL_PORT)"
            )
        gen = b""
        if flags & _FLAG_GENERATION:
            try:
                gen = _recv_exact(sock, _GEN.size, deadline)
            except TimeoutError:
                raise _Closed() from None
        wants_secret = bool(flags & _FLAG_SECRET)
        if wants_secret != (self._secret is not None):
            mine, theirs = (("has no secret", "wants one") if wants_secret
                            else ("has a secret", "runs open"))
            raise DDLConfigError(
                f"rank {self.rank}: the secrets differ: this rank {mine} and ddl's rendezvous "
                f"at {self._where} {theirs} (DDL_JOB_SECRET must be the same on every rank; "
                "ddlrun sets it)"
            )
        if self.generation is not None:
            found = _GEN.unpack(gen)[0] if gen else None
            if found != self.generation:
                raise _OtherGeneration(found)
        if self._secret is None:
            return
        mine = os.urandom(_NONCE)
        sock.sendall(_proof(self._secret, _CLIENT_LABEL, nonce) + mine)
        try:
            theirs = _recv_exact(sock, _NONCE, deadline)
        except (_Closed, ConnectionResetError):
            raise _CutOff() from None
        if theirs == _NO_PROOF:
            raise DDLConfigError(
                f"rank {self.rank}: ddl's rendezvous at {self._where} refused this rank's "
                "secret: the secrets differ (DDL_JOB_SECRET or DDL_JOB_SECRET_FILE must be "
                "the same on every rank)")
        if not hmac.compare_digest(theirs, _proof(self._secret, _SERVER_LABEL, mine + gen)):
            raise DDLConfigError(
                f"rank {self.rank}: the process at {self._where} does not know the job's "
                "secret: another job holds the port (set MASTER_PORT or DDL_PORT), or the "
                "secrets differ (DDL_JOB_SECRET must be the same on every rank)"
            )

    def _take(self, what: str) -> socket.socket:
        with self._lock:
            if self._closed:
                raise DDLError(f"rank {self.rank}: ddl's rendezvous client is closed")
            if self._lost:  # fail at once rather than wait for a server that is gone
                raise self._lost_error(what)
            if self._idle:
                return self._idle.pop()
        return self._open(time.monotonic() + self.timeout, what)

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._all.discard(sock)
        sock.close()

    def _call(self, op: _Op, fields: Sequence[bytes], what: str,
              wait: float | None = None) -> tuple[int, list[bytes]]:
        """One request and its reply; ``wait``: how long the server may block on it."""
        sock = self._take(what)
        try:
            sock.settimeout(self.timeout if wait is None else wait + _REPLY_SLACK)
            sock.sendall(_frame(op, fields))
            code, reply = _recv_frame(sock)
        except TimeoutError:
            self._drop(sock)
            raise DDLPeerError(
                f"rank {self.rank}: {what}: ddl's rendezvous at {self._where} did not answer "
                "(rank 0 stuck or gone?)"
            ) from None
        except (OSError, _Closed, struct.error):
            self._drop(sock)
            if self._closed:
                raise DDLError(f"rank {self.rank}: {what}: ddl's rendezvous client was closed "
                               "during the call") from None
            raise self._lost_error(what) from None
        except BaseException:
            self._drop(sock)  # a reply may still come: this connection is out of step
            raise
        self._give(sock)
        if code == _Status.ERROR:
            raise DDLError(f"rank {self.rank}: {what} failed in ddl's rendezvous: "
                           f"{reply[0].decode(errors='replace')}")
        return code, reply

    def _timed_out(self, what: str, missing: list[bytes], timeout: float) -> DDLTimeoutError:
        keys = [k.decode(errors="replace") for k in missing]
        return DDLTimeoutError(
            f"rank {self.rank}: {what} timed out after {round(timeout, 2):g}s in ddl's "
            f"rendezvous at {self._where}; still missing: {keys} (a rank that should write "
            "them stopped or has not started; DDL_TIMEOUT sets the limit)"
        )

    # --------------------------------------------------------------- commands
    def set(self, key: str, value: bytes) -> None:
        self._call(_Op.SET, [key.encode(), bytes(value)], f"set({key!r})")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds (default: the client's)
        for some rank to set it."""
        timeout = self.timeout if timeout is None else timeout
        what = f"get({key!r})"
        code, reply = self._call(_Op.GET, [key.encode(), _ms(timeout)], what, wait=timeout)
        if code == _Status.TIMEOUT:
            raise self._timed_out(what, reply, timeout)
        return reply[0]

    def add(self, key: str, n: int) -> int:
        """Add ``n`` to the counter ``key`` (0 when missing); the new value."""
        _, reply = self._call(_Op.ADD, [key.encode(), _I64.pack(n)], f"add({key!r})")
        return _I64.unpack(reply[0])[0]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is missing and ``expected``
        is empty); the value it holds afterwards (torch's semantics)."""
        _, reply = self._call(_Op.COMPARE_SET, [key.encode(), bytes(expected), bytes(desired)],
                              f"compare_set({key!r})")
        return reply[0]

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists, without waiting."""
        _, reply = self._call(_Op.CHECK, [k.encode() for k in keys], f"check({list(keys)})")
        return reply[0] == b"\x01"

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Until every key exists, or DDLTimeoutError after ``timeout`` seconds."""
        timeout = self.timeout if timeout is None else timeout
        what = f"wait({list(keys)})"
        code, reply = self._call(_Op.WAIT, [_ms(timeout), *(k.encode() for k in keys)], what,
                                 wait=timeout)
        if code == _Status.TIMEOUT:
            raise self._timed_out(what, reply, timeout)

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        _, reply = self._call(_Op.DELETE, [key.encode()], f"delete({key!r})")
        return reply[0] == b"\x01"

    def num_keys(self) -> int:
        _, reply = self._call(_Op.NUM_KEYS, [], "num_keys()")
        return _I64.unpack(reply[0])[0]

    def close(self) -> None:
        """Close every connection; calls in flight on other threads fail at once."""
        with self._lock:
            self._closed = True
            socks, self._all, self._idle = list(self._all), set(), []
        for sock in socks:
            _shutdown(sock)
            sock.close()


class _CutOff(Exception):
    """The server hung up after our proof without answering it: our handshake was evicted
    (a refusal says so, ``_NO_PROOF``)."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)


class _OtherGeneration(Exception):
    """The server is another ``ddl.init()``'s (``found``: its generation, None: it names
    none): an earlier one's that rank 0 has not closed yet, or a later one's."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)

    def __init__(self, found: int | None):
        super().__init__(found)
        self.found = found


# ---------------------------------------------------------------------- the job's
class Rendezvous:
    """This rank's part of the job's store: the client, and on rank 0 the server too."""

    def __init__(self, client: StoreClient, server: StoreServer | None = None):
        self.client = client
        self.server = server

    def close(self) -> None:
        """Close the client, then (rank 0) the server: peers still using it get
        DDLPeerError, never a hang. When to call it is the caller's business."""
        try:
            self.client.close()
        finally:
            if self.server is not None:
                self.server.close()


def connect(rank: int, size: int, addr: str, port: int, secret: bytes | None,
            timeout: float, generation: int | None = None) -> Rendezvous:
    """Join the job's store at ``addr:port``: rank 0 serves it, every rank (rank 0 too) is a
    client of it. ``secret`` must be the same on every rank (None: an open store);
    ``generation`` too (which ``ddl.init()`` of the job this is; see StoreServer)."""
    server = None
    if rank == 0:
        server = StoreServer(addr, port, secret, timeout=timeout, generation=generation)
        port = server.port
        if secret is None:
            log.warning("ddl: the rendezvous at %s:%d is open: no DDL_JOB_SECRET (ddlrun sets "
                        "one; see docs/security.md)", addr, port)
    try:
        client = StoreClient(addr, port, secret, rank=rank, timeout=timeout,
                             generation=generation)
    except BaseException:
        if server is not None:
            server.close()
        raise
    return Rendezvous(client, server)
