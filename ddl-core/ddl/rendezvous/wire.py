"""What the store's server and client say to each other: the handshake and the frames.

The handshake: the server's hello (``HELLO``: magic, flags, its nonce; with
``FLAG_GENERATION`` a ``GEN`` follows), then, when the job has a secret, the client's proof
(HMAC-SHA256 of the secret over ``CLIENT_LABEL`` and the server's nonce) and its own nonce,
and the server's proof back over ``SERVER_LABEL``, the client's nonce and the generation
(``NO_PROOF`` instead when the client's proof was wrong).

After it, every request and reply is one frame, ``!BI`` (``Op`` or ``Status``, body length)
then the body, a sequence of ``!I``-length-prefixed fields. Keys are UTF-8 text, values
bytes; ``add`` keeps its counter as decimal text, as torch does.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct
import time
from collections.abc import Iterable

HANDSHAKE_TIMEOUT = 10.0  # seconds a connection may take to prove the secret
MAX_FRAME = 1 << 30

MAGIC = b"DDLS1"
HELLO = struct.Struct("!5sB32s")  # magic, flags, server nonce
FLAG_SECRET = 1
FLAG_GENERATION = 2  # a !I generation follows the hello (a server of ddl.init's)
GEN = struct.Struct("!I")
NONCE = 32
# What a wrong proof gets back (after the server's refuse delay) instead of the server's
# proof: a constant that tells nothing, but tells a refused client apart from one whose
# handshake was cut off (evicted by a flood of strangers), which hears nothing and tries
# again.
NO_PROOF = bytes(NONCE)
CLIENT_LABEL = b"ddl-store-client"
SERVER_LABEL = b"ddl-store-server"
HEAD = struct.Struct("!BI")
LEN = struct.Struct("!I")
I64 = struct.Struct("!q")


class Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    CHECK = 5
    WAIT = 6
    DELETE = 7
    NUM_KEYS = 8


class Status(enum.IntEnum):
    OK = 0
    TIMEOUT = 1  # fields: the keys still missing
    ERROR = 2  # field: a message


class Closed(Exception):
    """The other end went away (or the frame was not ours)."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)


def frame(code: int, fields: Iterable[bytes]) -> bytes:
    """One request or reply: ``code`` (an Op or a Status) and its fields, framed."""
    parts = []
    for f in fields:
        parts.append(LEN.pack(len(f)))
        parts.append(f)
    body = b"".join(parts)
    return HEAD.pack(code, len(body)) + body


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes from ``sock``; Closed when it ends first, TimeoutError past ``deadline``."""
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
            raise Closed()
        got += k
    return bytes(buf)


def split_fields(body: bytes) -> list[bytes]:
    """A frame's body as its fields; Closed when the lengths do not add up."""
    fields, at, size = [], 0, len(body)
    while at < size:
        if at + LEN.size > size:
            raise Closed()
        (k,) = LEN.unpack_from(body, at)
        at += LEN.size
        if at + k > size:
            raise Closed()
        fields.append(body[at:at + k])
        at += k
    return fields


def recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    """The next frame on a blocking ``sock``: its code and fields."""
    code, size = HEAD.unpack(recv_exact(sock, HEAD.size))
    if size > MAX_FRAME:
        raise Closed()
    return code, split_fields(recv_exact(sock, size) if size else b"")


def proof(secret: bytes, label: bytes, nonce: bytes) -> bytes:
    """What proves ``secret`` over ``nonce``; ``label`` keeps the two sides' proofs apart."""
    return hmac.new(secret, label + nonce, hashlib.sha256).digest()


def ms(seconds: float) -> bytes:
    """A timeout as the wire carries it: whole milliseconds, never negative."""
    return I64.pack(max(0, int(seconds * 1000)))
