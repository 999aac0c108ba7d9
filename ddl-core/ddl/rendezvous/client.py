"""The store's client: one rank's pool of connections to rank 0's server.

Each connection passes ``wire``'s handshake before it is used: the client checks that the
server greets as ddl's store, runs the same ``ddl.init()`` (generation) and, with a secret,
proves it and checks the server's proof back, so a process squatting on the port cannot feed
the job keys. Errors name the rank, the call and the store's address, and say whether rank 0
is gone (DDLPeerError), a key never came (DDLTimeoutError) or the setup is wrong
(DDLConfigError: the secrets or the port).
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

from ..errors import DDLConfigError, DDLError, DDLPeerError, DDLTimeoutError
from .wire import (
    CLIENT_LABEL,
    FLAG_GENERATION,
    FLAG_SECRET,
    GEN,
    HANDSHAKE_TIMEOUT,
    HELLO,
    I64,
    MAGIC,
    NO_PROOF,
    NONCE,
    SERVER_LABEL,
    Closed,
    Op,
    Status,
    frame,
    ms,
    proof,
    recv_exact,
    recv_frame,
)

_REPLY_SLACK = 5.0  # how much longer than a blocking wait the client waits for the reply


class _CutOff(Exception):
    """The server hung up after our proof without answering it: our handshake was evicted
    (a refusal says so, ``NO_PROOF``)."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)


class _OtherGeneration(Exception):
    """The server is another ``ddl.init()``'s (``found``: its generation, None: it names
    none): an earlier one's that rank 0 has not closed yet, or a later one's."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)

    def __init__(self, found: int | None):
        super().__init__(found)
        self.found = found


def _shutdown(sock: socket.socket) -> None:
    """Wake whoever is blocked on ``sock`` (close alone does not, on Linux)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class StoreClient:
    """A connection to the store for one rank. Thread-safe: each call takes a connection
    from a pool (opening one when all are busy), so a thread blocked in ``get`` never holds
    up another thread's ``set`` that would end its wait.

    ``generation``: the store of which ``ddl.init()`` to join (see server.StoreServer); None
    takes whichever serves the port."""

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
            except (OSError, Closed) as exc:
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
            magic, flags, nonce = HELLO.unpack(recv_exact(sock, HELLO.size, deadline))
        except TimeoutError:
            raise DDLConfigError(
                f"rank {self.rank}: {self._where} did not greet as ddl's rendezvous does: "
                "another program holds the port (set MASTER_PORT or DDL_PORT)"
            ) from None
        if magic != MAGIC:
            raise DDLConfigError(
                f"rank {self.rank}: {self._where} is not ddl's rendezvous (another program "
                "holds the port? set MASTER_PORT or DDL_PORT)"
            )
        gen = b""
        if flags & FLAG_GENERATION:
            try:
                gen = recv_exact(sock, GEN.size, deadline)
            except TimeoutError:
                raise Closed() from None
        wants_secret = bool(flags & FLAG_SECRET)
        if wants_secret != (self._secret is not None):
            mine, theirs = (("has no secret", "wants one") if wants_secret
                            else ("has a secret", "runs open"))
            raise DDLConfigError(
                f"rank {self.rank}: the secrets differ: this rank {mine} and ddl's rendezvous "
                f"at {self._where} {theirs} (DDL_JOB_SECRET must be the same on every rank; "
                "ddlrun sets it)"
            )
        if self.generation is not None:
            found = GEN.unpack(gen)[0] if gen else None
            if found != self.generation:
                raise _OtherGeneration(found)
        if self._secret is None:
            return
        mine = os.urandom(NONCE)
        sock.sendall(proof(self._secret, CLIENT_LABEL, nonce) + mine)
        try:
            theirs = recv_exact(sock, NONCE, deadline)
        except (Closed, ConnectionResetError):
            raise _CutOff() from None
        if theirs == NO_PROOF:
            raise DDLConfigError(
                f"rank {self.rank}: ddl's rendezvous at {self._where} refused this rank's "
                "secret: the secrets differ (DDL_JOB_SECRET or DDL_JOB_SECRET_FILE must be "
                "the same on every rank)")
        if not hmac.compare_digest(theirs, proof(self._secret, SERVER_LABEL, mine + gen)):
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

    def _call(self, op: Op, fields: Sequence[bytes], what: str,
              wait: float | None = None) -> tuple[int, list[bytes]]:
        """One request and its reply; ``wait``: how long the server may block on it."""
        sock = self._take(what)
        try:
            sock.settimeout(self.timeout if wait is None else wait + _REPLY_SLACK)
            sock.sendall(frame(op, fields))
            code, reply = recv_frame(sock)
        except TimeoutError:
            self._drop(sock)
            raise DDLPeerError(
                f"rank {self.rank}: {what}: ddl's rendezvous at {self._where} did not answer "
                "(rank 0 stuck or gone?)"
            ) from None
        except (OSError, Closed, struct.error):
            self._drop(sock)
            if self._closed:
                raise DDLError(f"rank {self.rank}: {what}: ddl's rendezvous client was closed "
                               "during the call") from None
            raise self._lost_error(what) from None
        except BaseException:
            self._drop(sock)  # a reply may still come: this connection is out of step
            raise
        self._give(sock)
        if code == Status.ERROR:
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
        self._call(Op.SET, [key.encode(), bytes(value)], f"set({key!r})")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds (default: the client's)
        for some rank to set it."""
        timeout = self.timeout if timeout is None else timeout
        what = f"get({key!r})"
        code, reply = self._call(Op.GET, [key.encode(), ms(timeout)], what, wait=timeout)
        if code == Status.TIMEOUT:
            raise self._timed_out(what, reply, timeout)
        return reply[0]

    def add(self, key: str, n: int) -> int:
        """Add ``n`` to the counter ``key`` (0 when missing); the new value."""
        _, reply = self._call(Op.ADD, [key.encode(), I64.pack(n)], f"add({key!r})")
        return I64.unpack(reply[0])[0]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is missing and ``expected``
        is empty); the value it holds afterwards (torch's semantics)."""
        _, reply = self._call(Op.COMPARE_SET, [key.encode(), bytes(expected), bytes(desired)],
                              f"compare_set({key!r})")
        return reply[0]

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists, without waiting."""
        _, reply = self._call(Op.CHECK, [k.encode() for k in keys], f"check({list(keys)})")
        return reply[0] == b"\x01"

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Until every key exists, or DDLTimeoutError after ``timeout`` seconds."""
        timeout = self.timeout if timeout is None else timeout
        what = f"wait({list(keys)})"
        code, reply = self._call(Op.WAIT, [ms(timeout), *(k.encode() for k in keys)], what,
                                 wait=timeout)
        if code == Status.TIMEOUT:
            raise self._timed_out(what, reply, timeout)

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        _, reply = self._call(Op.DELETE, [key.encode()], f"delete({key!r})")
        return reply[0] == b"\x01"

    def num_keys(self) -> int:
        _, reply = self._call(Op.NUM_KEYS, [], "num_keys()")
        return I64.unpack(reply[0])[0]

    def close(self) -> None:
        """Close every connection; calls in flight on other threads fail at once."""
        with self._lock:
            self._closed = True
            socks, self._all, self._idle = list(self._all), set(), []
        for sock in socks:
            _shutdown(sock)
            sock.close()
