"""ddl's rendezvous store: what it serves, to whom, and how its waits end.

In-process servers for the store's semantics; real processes for torch's groups on it and
for a stranger (another uid) poking a live job's store."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ddl import rendezvous as rdv
from ddl.errors import DDLConfigError, DDLError, DDLPeerError, DDLTimeoutError
from ddlrun.preflight import pick_free_pair as free_port

SECRET = b"the-job-secret"
LOCAL = "127.0.0.1"


@pytest.fixture
def server():
    s = rdv.StoreServer(LOCAL, 0, SECRET, timeout=10)
    yield s
    s.close()


def client(server, rank=1, secret=SECRET, timeout=10.0) -> rdv.StoreClient:
    return rdv.StoreClient(LOCAL, server.port, secret, rank=rank, timeout=timeout)


def refused(addr: str, port: int, family=socket.AF_INET) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect((addr, port))
        except (ConnectionRefusedError, OSError):
            return True
        return False


# --------------------------------------------------------------------------- semantics
def test_commands_follow_torch_store_semantics(server):
    c = client(server)
    c.set("a", b"\x00bytes\xff")
    assert c.get("a") == b"\x00bytes\xff"
    assert c.add("n", 2) == 2 and c.add("n", -5) == -3
    assert c.get("n") == b"-3"  # counters are decimal text, as in torch
    assert c.compare_set("k", b"x", b"y") == b"x" and not c.check(["k"])  # missing: expected
    assert c.compare_set("k", b"", b"y") == b"y" and c.get("k") == b"y"  # missing, "": set
    assert c.compare_set("k", b"z", b"w") == b"y"  # mismatch: current, unchanged
    assert c.compare_set("k", b"y", b"w") == b"w" and c.get("k") == b"w"
    assert c.check(["a", "n", "k"]) and not c.check(["a", "nope"])
    assert c.num_keys() == 3
    assert c.delete("k") and not c.delete("k") and c.num_keys() == 2
    c.wait(["a", "n"], timeout=0.1)
    c.close()


def test_get_and_wait_block_until_another_rank_sets(server):
    c0, c1 = client(server, 0), client(server, 1)
    threading.Timer(0.3, lambda: (c1.set("late", b"v"), c1.set("later", b"w"))).start()
    t = time.monotonic()
    assert c0.get("late", timeout=10) == b"v"
    c0.wait(["late", "later"], timeout=10)
    assert 0.2 < time.monotonic() - t < 5
    c0.close()
    c1.close()


def test_a_blocked_get_does_not_hold_up_another_thread_of_the_same_client(server):
    c = client(server)
    got = []
    t = threading.Thread(target=lambda: got.append(c.get("k", timeout=10)))
    t.start()
    time.sleep(0.2)
    c.set("k", b"1")  # would deadlock on one shared connection
    t.join(5)
    assert got == [b"1"]
    c.close()


def test_timeouts_name_the_rank_the_keys_and_the_timeout(server):
    c = client(server, rank=3)
    c.set("there", b"1")
    t = time.monotonic()
    with pytest.raises(DDLTimeoutError) as e:
        c.get("never", timeout=0.4)
    assert 0.3 < time.monotonic() - t < 3
    assert "rank 3" in str(e.value) and "'never'" in str(e.value) and "0.4s" in str(e.value)
    with pytest.raises(DDLTimeoutError) as e:
        c.wait(["there", "gone"], timeout=0.3)
    assert "rank 3" in str(e.value) and "['gone']" in str(e.value) and "0.3s" in str(e.value)
    c.close()


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_rank_of_the_next_init_waits_out_the_last_inits_store(secret):
    """After shutdown, a rank's next init may reach rank 0 before rank 0 closed the last
    init's store on the same port: it must wait for the new store, not join the old one and
    its keys (nor fail on it), and a client of the old one must not slip into the new one."""
    port = free_port()
    old = rdv.StoreServer(LOCAL, port, secret, timeout=10, generation=1)
    stale = rdv.StoreClient(LOCAL, port, secret, rank=2, timeout=10, generation=1)
    stale.set("ddl/d0l0/here/1", b"1")
    got = []
    t = threading.Thread(target=lambda: got.append(
        rdv.StoreClient(LOCAL, port, secret, rank=1, timeout=10, generation=2)))
    t.start()
    time.sleep(0.5)
    assert not got  # still waiting: the store on the port is init #1's
    stale._idle.clear()  # its next call needs a new connection
    old.close()
    new = rdv.StoreServer(LOCAL, port, secret, timeout=10, generation=2)
    try:
        t.join(10)
        assert got
        assert not got[0].check(["ddl/d0l0/here/1"])  # a fresh store
        with pytest.raises(DDLPeerError, match="lost ddl's rendezvous"):
            stale.set("k", b"v")
        assert not got[0].check(["k"])
        with pytest.raises(DDLPeerError, match="init #2 of the job, this rank is at init #1"):
            rdv.StoreClient(LOCAL, port, secret, rank=3, timeout=2, generation=1)
        got[0].close()
    finally:
        stale.close()
        new.close()


def test_a_rank_waiting_for_the_next_inits_store_times_out_saying_so():
    s = rdv.StoreServer(LOCAL, 0, SECRET, timeout=10, generation=4)
    try:
        with pytest.raises(DDLTimeoutError) as e:
            rdv.StoreClient(LOCAL, s.port, SECRET, rank=1, timeout=0.5, generation=5)
        assert "rank 1" in str(e.value) and "init #4" in str(e.value)
    finally:
        s.close()


def test_no_server_is_a_timeout_naming_the_rank_and_address():
    port = free_port()
    t = time.monotonic()
    with pytest.raises(DDLTimeoutError) as e:
        rdv.StoreClient(LOCAL, port, SECRET, rank=5, timeout=0.5)
    assert time.monotonic() - t < 3
    assert "rank 5" in str(e.value) and f"{LOCAL}:{port}" in str(e.value)


def test_client_waits_for_rank_0_to_come_up():
    port = free_port()
    got = []
    t = threading.Thread(target=lambda: got.append(
        rdv.StoreClient(LOCAL, port, SECRET, rank=1, timeout=10)))
    t.start()
    time.sleep(0.5)
    s = rdv.StoreServer(LOCAL, port, SECRET, timeout=10)
    try:
        t.join(10)
        assert got
        got[0].set("k", b"v")
        got[0].close()
    finally:
        s.close()


def test_a_dead_server_is_a_peer_error_at_once_not_a_hang():
    s = rdv.StoreServer(LOCAL, 0, SECRET, timeout=10)
    c = client(s, rank=2)
    errors = []

    def blocked():
        try:
            c.get("never", timeout=60)
        except DDLError as exc:
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    s.close()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - start < 3
    assert isinstance(errors[0], DDLPeerError)
    assert "rank 2" in str(errors[0]) and "lost ddl's rendezvous" in str(errors[0])
    start = time.monotonic()
    with pytest.raises(DDLPeerError):
        c.set("k", b"v")
    assert time.monotonic() - start < 1, "later calls must not wait for a server that is gone"
    c.close()


def test_rank_0_closing_fails_the_peers_in_flight_calls():
    port = free_port()
    r0 = rdv.connect(0, 2, LOCAL, port, SECRET, 10)
    r1 = rdv.connect(1, 2, LOCAL, port, SECRET, 10)
    errors = []
    t = threading.Thread(target=lambda: _catch(errors, r1.client.wait, ["never"], 60))
    t.start()
    time.sleep(0.2)
    r0.close()
    t.join(5)
    assert errors and isinstance(errors[0], DDLPeerError)
    r1.close()


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except DDLError as exc:
        errors.append(exc)


def test_a_wait_completed_just_before_close_still_gets_its_answer():
    s = rdv.StoreServer(LOCAL, 0, SECRET, timeout=10)
    c0, c1 = client(s, 0), client(s, 1)
    errors, done = [], []
    t = threading.Thread(target=lambda: (_catch(errors, c1.wait, ["k"], 30), done.append(1)))
    t.start()
    time.sleep(0.3)
    c0.set("k", b"1")  # the usual end of a job: the last rank arrives, rank 0 closes
    s.close()
    t.join(5)
    assert done and not errors, errors
    c0.close()
    c1.close()


def test_one_thread_serves_every_connection():
    before = threading.active_count()
    s = rdv.StoreServer(LOCAL, 0, SECRET, timeout=10)
    clients = [client(s, r) for r in range(8)]
    parked = [threading.Thread(target=_catch, args=([], c.get, "later", 30)) for c in clients]
    for t in parked:
        t.start()
    time.sleep(0.3)
    assert threading.active_count() == before + 1 + len(parked)
    clients[0].set("later", b"1")
    for t in parked:
        t.join(5)
    for c in clients:
        c.close()
    s.close()
    assert threading.active_count() == before


def test_port_in_use_says_so(server):
    with pytest.raises(DDLConfigError) as e:
        rdv.StoreServer(LOCAL, server.port, SECRET, timeout=1)
    assert f"port {server.port} on {LOCAL} is in use" in str(e.value)
    assert "MASTER_PORT or DDL_PORT" in str(e.value)


# ------------------------------------------------------------------------ who is served
def test_binds_only_the_jobs_address(server):
    assert server._sock.getsockname()[0] == LOCAL  # never the wildcard
    assert not refused(LOCAL, server.port)
    # all of 127/8 is loopback on Linux: another local address, same port, is not served
    assert refused("127.0.0.2", server.port)
    if socket.has_ipv6:
        assert refused("::1", server.port, socket.AF_INET6)


def test_ipv6_address_binds_ipv6_only():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        s = rdv.StoreServer("::1", 0, SECRET, timeout=10)
    except DDLConfigError as exc:
        pytest.skip(f"cannot listen on ::1 here: {exc}")
    try:
        c = rdv.StoreClient("::1", s.port, SECRET, rank=1, timeout=5)
        c.set("k", b"v")
        assert c.get("k") == b"v"
        c.close()
        assert refused(LOCAL, s.port)
    finally:
        s.close()


def _hello(sock) -> tuple[int, bytes]:
    data = b""
    while len(data) < rdv._HELLO.size:
        chunk = sock.recv(rdv._HELLO.size - len(data))
        assert chunk
        data += chunk
    _, flags, nonce = rdv._HELLO.unpack(data)
    return flags, nonce


def _rest(sock, wait=2.0) -> tuple[bytes, bool]:
    """What the server sends after its hello, and whether it hung up within ``wait``."""
    sock.settimeout(wait)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return got, False
    except OSError:
        pass
    return got, True


def _frames() -> bytes:
    def frame(op, *fields):
        body = b"".join(struct.pack("!I", len(f)) + f for f in fields)
        return struct.pack("!BI", op, len(body)) + body
    return (frame(rdv._Op.SET, b"planted", b"x") + frame(rdv._Op.GET, b"a", struct.pack("!q", 0))
            + frame(rdv._Op.NUM_KEYS))


def test_a_wrong_proof_reads_nothing_writes_nothing_and_others_are_still_served(server):
    c = client(server)
    c.set("a", b"private")
    keys = c.num_keys()
    with socket.create_connection((LOCAL, server.port)) as s:
        flags, nonce = _hello(s)
        assert flags & 1  # the server asks for a proof
        wrong = hmac.new(b"guess", b"ddl-store-client" + nonce, hashlib.sha256).digest()
        s.sendall(wrong + os.urandom(32) + _frames())
        # meanwhile the job goes on
        c.set("b", b"1")
        got, closed = _rest(s)
    assert got == rdv._NO_PROOF and closed  # "no", a constant: nothing of the job's
    with socket.create_connection((LOCAL, server.port)) as s:  # commands, no handshake
        _hello(s)
        s.sendall(_frames() * 4)
        got, closed = _rest(s)
    assert got == rdv._NO_PROOF and closed  # read as a wrong proof
    assert not c.check(["planted"]) and c.num_keys() == keys + 1 and c.get("a") == b"private"
    c.close()


def test_a_client_with_another_secret_is_told_the_secrets_differ(server):
    t = time.monotonic()
    with pytest.raises(DDLConfigError) as e:
        client(server, rank=4, secret=b"other")
    assert "rank 4" in str(e.value) and "DDL_JOB_SECRET" in str(e.value)
    assert time.monotonic() - t < 5


@pytest.mark.parametrize("server_secret, client_secret", [(SECRET, None), (None, SECRET)])
def test_secret_on_one_side_only_is_a_config_error(server_secret, client_secret):
    s = rdv.StoreServer(LOCAL, 0, server_secret, timeout=10)
    try:
        with pytest.raises(DDLConfigError) as e:
            rdv.StoreClient(LOCAL, s.port, client_secret, rank=1, timeout=5)
        assert "secrets differ" in str(e.value) and "DDL_JOB_SECRET" in str(e.value)
    finally:
        s.close()


def _squatter(reply) -> tuple[socket.socket, threading.Thread]:
    """A process on the job's port that is not the job's rendezvous."""
    lsock = socket.create_server((LOCAL, 0))

    def serve():
        conn, _ = lsock.accept()
        with conn:
            reply(conn)
            time.sleep(0.5)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lsock, t


@pytest.mark.parametrize("kind", ["open", "fake-proof", "not-ddl"])
def test_a_squatter_on_the_port_cannot_feed_the_job(kind):
    def reply(conn):
        if kind == "not-ddl":
            conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 64)
            return
        flags = 0 if kind == "open" else 1
        conn.sendall(rdv._HELLO.pack(rdv._MAGIC, flags, os.urandom(32)))
        conn.recv(64)
        conn.sendall(os.urandom(32))  # it cannot compute the server's proof

    lsock, t = _squatter(reply)
    try:
        with pytest.raises(DDLConfigError):
            rdv.StoreClient(LOCAL, lsock.getsockname()[1], SECRET, rank=1, timeout=5)
    finally:
        lsock.close()


def test_silent_strangers_neither_hold_threads_nor_lock_the_job_out():
    s = rdv.StoreServer(LOCAL, 0, SECRET, timeout=10, handshake_timeout=1.0, max_pending=8)
    strangers = [socket.create_connection((LOCAL, s.port)) for _ in range(40)]
    try:
        t = time.monotonic()
        c = client(s)  # gets in though strangers fill every handshake slot
        c.set("k", b"v")
        assert c.get("k") == b"v" and time.monotonic() - t < 5
        for sock in strangers:  # each was hung up on: evicted, or out of handshake time
            _hello(sock)
            got, closed = _rest(sock, wait=5)
            assert got == b"" and closed
        c.close()
    finally:
        for sock in strangers:
            sock.close()
        s.close()


def test_open_store_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger="ddl")
    port = free_port()
    r0 = rdv.connect(0, 2, LOCAL, port, None, 10)
    r1 = rdv.connect(1, 2, LOCAL, port, None, 10)
    try:
        r1.client.set("k", b"v")
        assert r0.client.get("k") == b"v"
    finally:
        r1.close()
        r0.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "ddl"]
    assert lines == [f"ddl: the rendezvous at {LOCAL}:{port} is open: no DDL_JOB_SECRET "
                     "(ddlrun sets one for a job it starts whole; with one launcher per "
                     "node, give every node the same DDL_JOB_SECRET or DDL_JOB_SECRET_FILE; "
                     "see docs/security.md)"]


# ------------------------------------------------------------------------ torch on it
def test_torch_store_adapter_through_prefix_store(server):
    dist = pytest.importorskip("torch.distributed")
    from ddl.engines.torch_store import TorchStore

    store = TorchStore(client(server))
    p = dist.PrefixStore("pre", store)  # calls come from C++, through the trampoline
    p.set("a", "1")
    assert p.get("a") == b"1" and store.get("pre/a") == b"1"
    assert p.add("n", 3) == 3
    assert p.compare_set("a", "1", "2") == b"2"
    assert p.check(["a", "n"]) and not p.check(["zz"])
    p.wait(["a"])
    p.wait(["a"], datetime.timedelta(seconds=1))
    assert p.num_keys() == 2 and p.delete_key("a") and not p.check(["a"])
    with pytest.raises(DDLTimeoutError):  # errors come back through C++ as ddl's own
        p.wait(["zz"], datetime.timedelta(seconds=0.2))
    store.set_timeout(datetime.timedelta(seconds=0.2))  # what a plain get waits
    with pytest.raises(DDLTimeoutError):
        p.get("zz")
    short = store.with_deadline(0.3)
    t = time.monotonic()
    with pytest.raises(DDLTimeoutError):
        dist.PrefixStore("pre", short).wait(["zz"], datetime.timedelta(seconds=30))
    assert time.monotonic() - t < 3, "the deadline bounds torch's own timeouts"
    store.client.close()


_WORKER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from ddl import rendezvous
    from ddl.dtypes import BY_NAME
    from ddl.engines.gloo import GlooContext
    from ddl.ops import ReduceOp

    mode, rank, size, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    secret = b"test-secret"
    rv = rendezvous.connect(rank, size, "127.0.0.1", port, secret, 60)
    c = rv.client
    out = {"rank": rank}

    def allreduce(g):
        buf = np.full(4, rank + 1, np.float32)
        g.allreduce(buf, BY_NAME["float32"], ReduceOp.SUM)
        return buf.tolist()

    def barrier(name):
        c.set(f"{name}/{rank}", b"1")
        c.wait([f"{name}/{r}" for r in range(size)], 120)

    if mode == "allreduce":
        ctx = GlooContext(rank, size, "127.0.0.1", port, 30.0, rendezvous=rv)
        g = ctx.group("world", tuple(range(size)), rank)
        out["sum"] = allreduce(g)
        g.close()
    elif mode == "missing":
        ctx = GlooContext(rank, size, "127.0.0.1", port, 2.0, rendezvous=rv)
        barrier("up")  # every rank alive: only the group is missing one
        if rank == size - 1:
            c.wait([f"done/{r}" for r in range(size - 1)], 120)
        else:
            t = time.monotonic()
            try:
                ctx.group("world", tuple(range(size)), rank)
            except Exception as exc:
                out["error"], out["kind"] = str(exc), type(exc).__name__
            out["took"] = time.monotonic() - t
            c.set(f"done/{rank}", b"1")
    elif mode == "stranger":
        ctx = GlooContext(rank, size, "127.0.0.1", port, 30.0, rendezvous=rv)
        g = ctx.group("world", tuple(range(size)), rank)
        out["before"] = allreduce(g)
        barrier("quiet")  # from here no rank writes a key until the stranger is done
        if rank == 0:
            c.set("job/private", b"precious")
            snapshot = dict(rv.server._data)
            print("READY", flush=True)
            sys.stdin.readline()  # the stranger has had its go
            out["unchanged"] = dict(rv.server._data) == snapshot
            c.set("go", b"1")
        else:
            c.wait(["go"], 120)
        out["after"] = allreduce(g)
        g.close()
    # rank 0 serves the store until everyone is done with it
    c.set(f"end/{rank}", b"1")
    if rank == 0:
        c.wait([f"end/{r}" for r in range(size)], 120)
    rv.close()
    print(json.dumps(out), flush=True)
""")


class _Job:
    """``size`` ranks of _WORKER in ``mode``; killed by pid whatever happens."""

    def __init__(self, tmp_path, mode: str, size: int):
        script = tmp_path / "worker.py"
        script.write_text(_WORKER)
        self.port = free_port()
        self.procs = [
            subprocess.Popen([sys.executable, str(script), mode, str(r), str(size),
                              str(self.port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
            for r in range(size)]

    def results(self, timeout=180) -> list[dict]:
        out = []
        for r, p in enumerate(self.procs):
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {r} still running after {timeout}s") from None
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            assert p.returncode == 0 and lines, f"rank {r} exit {p.returncode}:\n{stderr[-3000:]}"
            out.append(json.loads(lines[-1]))
        return out

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_gloo_groups_run_on_the_store(tmp_path):
    pytest.importorskip("torch")
    job = _Job(tmp_path, "allreduce", 2)
    try:
        reps = job.results()
    finally:
        job.kill()
    assert [r["sum"] for r in reps] == [[3.0] * 4] * 2


def test_group_creation_names_the_member_that_never_came(tmp_path):
    pytest.importorskip("torch")
    job = _Job(tmp_path, "missing", 3)
    try:
        reps = job.results()
    finally:
        job.kill()
    for r in reps[:2]:
        assert r["kind"] == "DDLTimeoutError", r
        assert f"rank {r['rank']}:" in r["error"] and "rank(s) [2] did not join" in r["error"]
        assert "2s" in r["error"] and "DistStoreError" not in r["error"]
        assert 1.5 < r["took"] < 10, r


def _stranger_python() -> str | None:
    """An interpreter that ``nobody`` may run (the venv's may live under /root)."""
    for exe in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        try:
            if exe and subprocess.run([exe, "-c", "pass"], user="nobody",
                                      capture_output=True).returncode == 0:
                return exe
        except OSError:
            continue
    return None


_STRANGER = textwrap.dedent("""
    import hashlib, hmac, json, os, socket, struct, sys
    port, frames = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
    report = {"uid": os.getuid(), "attempts": {}}

    def attempt(name, addr, send):
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect((addr, port))
        except OSError as exc:
            report["attempts"][name] = {"connected": False, "error": str(exc)}
            return
        got = b""
        try:
            hello = s.recv(38)
            s.sendall(send(hello))
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
        report["attempts"][name] = {"connected": True, "hello": len(hello), "got": got.hex()}
        s.close()

    def proof(key):
        return lambda hello: hmac.new(key, b"ddl-store-client" + hello[6:],
                                      hashlib.sha256).digest() + os.urandom(32) + frames
    attempt("commands without a handshake", "127.0.0.1", lambda hello: frames * 8)
    attempt("guessed secret", "127.0.0.1", proof(b"guess"))
    attempt("empty secret", "127.0.0.1", proof(b""))
    attempt("open-store client", "127.0.0.1", lambda hello: frames + b"\\0" * 64)
    attempt("another loopback address", "127.0.0.2", lambda hello: frames)
    attempt("ipv6 loopback", "::1", lambda hello: frames)
    print(json.dumps(report))
""")


def test_another_user_gets_nothing_from_a_live_job(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the stranger as another uid (nobody)")
    pytest.importorskip("torch")
    exe = _stranger_python()
    if exe is None:
        pytest.skip("no Python interpreter that the user nobody may run")
    job = _Job(tmp_path, "stranger", 2)
    try:
        line = job.procs[0].stdout.readline()
        assert line.strip() == "READY", line
        stranger = subprocess.run([exe, "-c", _STRANGER, str(job.port), _frames().hex()],
                                  user="nobody", capture_output=True, text=True, timeout=120)
        job.procs[0].stdin.write("go\n")
        job.procs[0].stdin.flush()
        reps = job.results()
    finally:
        job.kill()
    assert stranger.returncode == 0, stranger.stderr
    report = json.loads(stranger.stdout)
    assert report["uid"] != 0
    tried = report["attempts"]
    for name, answer in (("commands without a handshake", rdv._NO_PROOF),
                         ("guessed secret", rdv._NO_PROOF), ("empty secret", rdv._NO_PROOF),
                         ("open-store client", rdv._NO_PROOF)):
        assert tried[name]["connected"] and tried[name]["got"] == answer.hex(), (name,
                                                                                 tried[name])
    assert not tried["another loopback address"]["connected"]
    assert not tried["ipv6 loopback"]["connected"]
    assert reps[0]["unchanged"]
    assert [r["before"] for r in reps] == [[3.0] * 4] * 2
    assert [r["after"] for r in reps] == [[3.0] * 4] * 2
