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

The rooms: ``wire`` (the handshake and the frames), ``server`` (StoreServer, rank 0's one
thread), ``client`` (StoreClient, a rank's pool of connections); here, the job's part of it:
``connect`` and ``Rendezvous``.
"""

from __future__ import annotations

import logging

from . import wire
from .client import StoreClient
from .server import MAX_PENDING, REFUSE_DELAY, PortInUse, StoreServer
from .wire import HANDSHAKE_TIMEOUT

# The wire's names as this module spelt them before it was split: tests speak the wire by
# hand (a squatter, a stale hello) through them.
_HELLO, _MAGIC, _NO_PROOF, _Op = wire.HELLO, wire.MAGIC, wire.NO_PROOF, wire.Op

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "MAX_PENDING",
    "REFUSE_DELAY",
    "PortInUse",
    "Rendezvous",
    "StoreClient",
    "StoreServer",
    "connect",
]

log = logging.getLogger("ddl")


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
                        "one for a job it starts whole; with one launcher per node, give "
                        "every node the same DDL_JOB_SECRET or DDL_JOB_SECRET_FILE; see "
                        "docs/security.md)", addr, port)
    try:
        client = StoreClient(addr, port, secret, rank=rank, timeout=timeout,
                             generation=generation)
    except BaseException:
        if server is not None:
            server.close()
        raise
    return Rendezvous(client, server)
