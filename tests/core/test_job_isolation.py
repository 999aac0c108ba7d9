"""Jobs never mix and nobody outside the job joins it: shared-memory segments are checked
for owner, mode and the job's token before a rank joins them."""

from __future__ import annotations

import os
import pwd
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque

import pytest

from ddl.engines import segments
from ddl.errors import DDLShmError
from ddl.perf.spawn import new_job_id
from ddlrun.preflight import pick_free_pair as free_port

INIT = "import ddl; ddl.init(); print('joined', flush=True); ddl.shutdown()"
MALLOC = ("import ddl; ddl.init(); a = ddl.malloc(10); a[:] = ddl.rank(); ddl.allreduce_(a); "
          "print('sum', a[0], flush=True); ddl.shutdown()")
# A refused rank ends with the DDLError uncaught: Python exits 1 (not a signal, not a hang).
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def _rank(code: str, rank: int, size: int, job: str, **env: str) -> subprocess.Popen:
    e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
             LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
             DDL_JOB_ID=job, DDL_INIT_TIMEOUT="8", PYTHONUNBUFFERED="1", **env)
    return subprocess.Popen([sys.executable, "-c", code], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float = 30) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def _plant(name: str, uid: int, mode: int, payload: bytes) -> str:
    path = os.path.join(segments.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(payload)
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


def _forged_ctl_header(size: int) -> bytes:
    # magic, layout, ranks, slot, creator pid (ours: alive), ready, token
    words = [0x4C44445F4D485344, 2, size, 4 << 20, os.getpid(), 1, 12345]
    return struct.pack(f"<{len(words)}q", *words).ljust(1 << 20, b"\0")


def test_a_second_job_with_the_same_id_and_another_secret_never_meets_the_first():
    """Job A runs (rank 0 waits for its peer). Job B reuses A's id with another secret: its
    segment names carry its own key, so B runs beside A without seeing A's segments, and A
    then finishes too."""
    job = new_job_id("same")
    a0 = _rank(MALLOC, 0, 2, job, DDL_JOB_SECRET="secret-a")
    try:
        deadline = time.monotonic() + 20
        while not segments.list_job(job) and time.monotonic() < deadline:
            time.sleep(0.02)
        b = [_rank(MALLOC, r, 2, job, DDL_JOB_SECRET="secret-b") for r in range(2)]
        for p in b:
            code, out, err = _finish(p)
            assert code == 0 and "sum 0.5" in out, err  # the mean of B's ranks 0 and 1
        a1 = _rank(MALLOC, 1, 2, job, DDL_JOB_SECRET="secret-a")
        for p in (a1, a0):
            code, out, err = _finish(p)
            assert code == 0 and "sum 0.5" in out, err
    finally:
        a0.kill()
        for secret in (b"secret-a", b"secret-b"):
            segments.cleanup_job(job, None, secret)


def test_a_segment_of_this_user_with_another_token_is_refused_on_every_path():
    """A file of our own uid, mode 0600, under the job's (keyed) control-segment name, whose
    header names a live creator but another job's token: a joining rank refuses it (token),
    the rank that would create it refuses to replace it (its creator runs)."""
    job = new_job_id("token")
    name = segments.segment_name(job, 0, "ctl", b"secret-a")
    path = _plant(name, os.geteuid(), 0o600, _forged_ctl_header(2))
    try:
        code, out, err = _finish(_rank(INIT, 1, 2, job, DDL_JOB_SECRET="secret-a"))
        assert code == 1 and "joined" not in out
        assert "belongs to another job" in err and "DDLShmError" in err, err
        code, out, err = _finish(_rank(INIT, 0, 2, job, DDL_JOB_SECRET="secret-a"))
        assert code == 1 and "joined" not in out
        assert "belongs to a running process" in err, err
        # and a cleanup with the job's secret leaves it: it does not carry the job's token
        assert segments.cleanup_job(job, None, b"secret-a") == [] and os.path.exists(path)
    finally:
        os.unlink(path)


def test_a_rank_claimed_twice_is_refused():
    job = new_job_id("twice")
    a0 = _rank(INIT, 0, 3, job)
    a1 = _rank("import time, ddl; ddl.init(); time.sleep(3); ddl.shutdown()", 1, 3, job)
    try:
        time.sleep(1.0)
        dup = _rank(INIT, 1, 3, job)
        code, out, err = _finish(dup)
        assert code == 1 and "already taken by pid" in err, err
    finally:
        for p in (a0, a1):
            p.kill()
            p.wait()
        segments.cleanup_job(job)


@root_only
def test_a_segment_planted_by_another_user_is_refused():
    nobody = pwd.getpwnam("nobody").pw_uid
    job = new_job_id("plant")
    name = segments.segment_name(job, 0, "ctl")
    path = _plant(name, nobody, 0o666, _forged_ctl_header(2))
    try:
        with pytest.raises(DDLShmError, match=r"belongs to nobody \(uid \d+\)"):
            segments.open_existing(name)
        for rank in (1, 0):  # a joining rank, and the rank that would create it
            code, out, err = _finish(_rank(INIT, rank, 2, job))
            assert code == 1 and "joined" not in out
            assert f"refusing shared memory {path}" in err and "nobody" in err, err
        assert os.stat(path).st_uid == nobody, "the planted file is left to its owner"
    finally:
        os.unlink(path)


def test_a_segment_with_a_loose_mode_or_a_link_is_refused(tmp_path):
    job = new_job_id("mode")
    name = segments.segment_name(job, 0, "ctl")
    path = _plant(name, os.geteuid(), 0o644, _forged_ctl_header(2))
    link = segments.segment_name(job, 0, "heap0-0")
    os.symlink(str(tmp_path / "target"), os.path.join(segments.SHM_DIR, link))
    try:
        with pytest.raises(DDLShmError, match=r"has mode -rw-r--r--, not -rw-------"):
            segments.open_existing(name)
        with pytest.raises(DDLShmError, match="symbolic link"):
            segments.open_existing(link)
        with pytest.raises(DDLShmError, match="already exists"):
            segments.create(link, 4096, 1)
        assert not (tmp_path / "target").exists(), "create must not follow a planted link"
    finally:
        os.unlink(path)
        os.unlink(os.path.join(segments.SHM_DIR, link))


@root_only
def test_a_planted_heap_name_gives_a_clear_error():
    nobody = pwd.getpwnam("nobody").pw_uid
    job = new_job_id("heap")
    heap = segments.segment_name(job, 0, "heap1-0")
    path = _plant(heap, nobody, 0o666, b"\0" * 4096)
    ranks = [_rank(MALLOC, r, 2, job) for r in range(2)]
    try:
        results = [_finish(p) for p in ranks]
        code, out, err = results[1]
        assert code == 1 and "SegmentExists" in err and "already exists" in err, err
        assert "owner nobody" in err and "ddlrun --cleanup" in err, err
        assert results[0][0] == 1, "its peer must not go on alone"
    finally:
        for p in ranks:
            p.kill()
        os.unlink(path)
        segments.cleanup_job(job)


MIX = ("import os, time, numpy as np, ddl; ddl.init(); v = float(os.environ['VAL']); "
       "a = np.full(1001, v, np.float64); out = [float(ddl.allreduce(a, op=ddl.Sum)[0]) "
       "for _ in range(10)]; print('RESULT', ddl.api.session().world.job_id, *out, flush=True); "
       "time.sleep(float(os.environ.get('HOLD', '0'))); ddl.shutdown()")


def _values(out: str) -> tuple[str, set[float]]:
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    _, job, *vals = line.split()
    return job, {float(v) for v in vals}


def _mpirun(val: float) -> subprocess.Popen:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDL_", "MASTER_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.Popen([mpirun, "--oversubscribe", "-np", "2", "-x", f"VAL={val}",
                             sys.executable, "-c", MIX], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _by_hand(val: float, port: int, secret: str | None = None, hold: float = 0,
             init_timeout: float = 20) -> list[subprocess.Popen]:
    """Two ranks with only the torchrun variables: no job id from anybody."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDL_", "MASTER_"))}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VAL=str(val),
               DDL_INIT_TIMEOUT=str(init_timeout), PYTHONUNBUFFERED="1", HOLD=str(hold))
    if secret:
        env["DDL_JOB_SECRET"] = secret
    return [subprocess.Popen([sys.executable, "-c", MIX], env=dict(env, RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for r in range(2)]


@pytest.mark.slow
@pytest.mark.mpi
def test_concurrent_mpirun_jobs_never_mix():
    """Plain ``mpirun -np 2`` twice at the same moment: each job gets the id of its own
    PMIx namespace. 50 pairs: zero mixed results, zero errors."""
    pytest.importorskip("mpi4py")
    ids = set()
    for _ in range(50):
        jobs = {1.0: _mpirun(1.0), 100.0: _mpirun(100.0)}
        for val, p in jobs.items():
            code, out, err = _finish(p, 60)
            assert code == 0, err[-3000:]
            for line in out.splitlines():
                job, vals = _values(line)
                assert vals == {2 * val}, f"mixed result {vals} in a job of value {val}"
                ids.add(job)
    assert len(ids) == 100, "every job has an id of its own"


@pytest.mark.slow
def test_concurrent_hand_started_jobs_never_mix():
    """Two jobs started by hand (torchrun variables only) at the same moment, 50 times:
    the ranks agree a random job id through the rendezvous: zero mixed results."""
    ids = set()
    for _ in range(50):
        port = free_port()
        jobs = {1.0: _by_hand(1.0, port), 100.0: _by_hand(100.0, free_port(avoid=[port]))}
        for val, ranks in jobs.items():
            seen = set()
            for p in ranks:
                code, out, err = _finish(p, 60)
                assert code == 0, err[-3000:]
                job, vals = _values(out)
                assert vals == {2 * val}, f"mixed result {vals} in a job of value {val}"
                seen.add(job)
            assert len(seen) == 1
            ids |= seen
    assert len(ids) == 100


@pytest.mark.slow
def test_hand_started_jobs_on_one_port_never_complete_with_each_others_ranks():
    """Two jobs by hand on the same MASTER_ADDR:MASTER_PORT with no secret, at the same
    moment or 0-50 ms apart: a rank of one could claim its number in the other's
    rendezvous before that job's own rank did, and both "jobs" completed with a sum of 101
    on every rank. Now the collision's signs (a rank claimed twice, a second rank 0 that
    cannot bind) fail every rank of the job within DDL_RENDEZVOUS_SETTLE: zero results
    from a stranger. (200 pairs by hand: docs/security.md.)"""
    rng = random.Random(7)
    failed = 0
    for trial in range(16):
        port = free_port()
        first = _by_hand(1.0, port, init_timeout=4)
        if trial % 2:
            time.sleep(rng.uniform(0, 0.05))
        second = _by_hand(100.0, port, init_timeout=4)
        for val, ranks in ((1.0, first), (100.0, second)):
            for p in ranks:
                code, out, err = _finish(p, 60)
                if code != 0:
                    failed += 1
                    assert "Traceback" not in err or "DDL" in err, err[-2000:]
                for line in out.splitlines():
                    if line.startswith("RESULT"):
                        _, vals = _values(line)
                        assert vals == {2 * val}, f"trial {trial}: a stranger's data {vals}"
    assert failed, "the jobs collided every time: some ranks must have failed"


def _listening(port: int) -> bool:
    """Whether something listens on ``port`` (read from /proc: connecting to a port nobody
    listens on can make the kernel connect the socket to itself, which squats the port)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(r[1].endswith(f":{port:04X}") and r[3] == "0A" for r in rows)


def _flood(port: int, stop: threading.Event, held: int = 225) -> None:
    """One flooding thread: once the store listens, connect to it over and over, keep the
    last ``held`` connections open (4 threads: up to 900), say nothing."""
    conns: deque = deque()
    while not _listening(port) and not stop.is_set():
        time.sleep(0.005)
    try:
        while not stop.is_set():
            try:
                conns.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
            except OSError:
                time.sleep(0.001)
                continue
            if len(conns) > held:
                conns.popleft().close()
    finally:
        for c in conns:
            c.close()


@pytest.mark.slow
def test_a_connection_flood_on_the_rendezvous_neither_stops_nor_misleads_a_job():
    """4 threads cycling up to 900 silent connections at the store while a job starts:
    pending handshakes were evicted and the third cut-off read as a wrong secret (`the
    secrets differ`, 3 of 5 starts). A cut-off is now retried until the init deadline;
    only a real refusal (the server's "no") says the secrets differ."""
    delays = []
    for trial in range(10):
        port = free_port()
        stop = threading.Event()
        threads = [threading.Thread(target=_flood, args=(port + 1, stop), daemon=True)
                   for _ in range(4)]
        for t in threads:
            t.start()
        try:
            t0 = time.monotonic()
            ranks = _by_hand(float(trial), port, secret=f"flood-{trial}")
            results = [_finish(p, 90) for p in ranks]
            delays.append(time.monotonic() - t0)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        for code, out, err in results:
            assert code == 0, f"trial {trial}: " + err[-3000:]
            assert _values(out)[1] == {2.0 * trial}
    print("start-to-end under the flood, s:", sorted(round(d, 2) for d in delays))


def test_a_second_job_on_the_same_port_fails_and_the_first_is_untouched():
    """Same MASTER_ADDR:MASTER_PORT, each job with its own secret: the second job's rank 0
    cannot bind the rendezvous, its rank 1 cannot prove the first job's secret; the first
    job's result is right."""
    port = free_port()
    first = _by_hand(1.0, port, "secret-one", hold=8)
    time.sleep(1.5)  # the first job's rendezvous is up
    second = _by_hand(100.0, port, "secret-two")
    results = [_finish(p, 60) for p in first]
    for code, out, err in results:
        assert code == 0, err[-3000:]
        assert _values(out)[1] == {2.0}
    # each rank fails for its own reason (either reason on either rank would hide a bug):
    # rank 0 cannot bind the store (DDL_PORT, default MASTER_PORT+1), rank 1 fails the proof
    whys = (f"port {port + 1} on 127.0.0.1 is in use", "secrets differ")
    for (code, out, err), why in zip((_finish(p, 60) for p in second), whys):
        assert code == 1 and "RESULT" not in out
        assert why in err, err[-3000:]


def test_a_rank_that_maps_the_segment_while_it_is_being_sized_maps_it_again():
    """``segments.create`` writes the token before it reserves the rest, so a joining rank
    can map a 56-byte file whose header local rank 0 then completes; it must map the
    sized file again, never use the short mapping (it did: ValueError on 1 run in ~900)."""
    from ddl import identity
    from ddl.engines import shm
    from ddl.errors import DDLTimeoutError

    job, token = new_job_id("sizing"), 4242
    slot = shm.staging_slot(64 << 10, 32 << 20, 2)
    name = segments.segment_name(job, 0, "ctl", identity.job_secret())
    words = [shm._MAGIC, shm._LAYOUT, 2, slot, os.getpid(), 1, token, 64 << 10]
    path = _plant(name, os.geteuid(), 0o600, struct.pack("<8q", *words))
    total = -(-(shm._HDR + 2 * shm._BLOCK) // 4096) * 4096 + 2 * 2 * slot
    grow = threading.Timer(0.3, os.truncate, (path, total))
    grow.start()
    try:
        # local rank 0 never attaches (its block stays empty): the wait for it is what ends
        with pytest.raises(DDLTimeoutError, match="local rank 0 did not attach"):
            shm.ShmEngine(job_id=job, host_index=0, local_rank=1, local_size=2,
                          global_rank=1, slot_bytes=64 << 10, init_timeout=1.5, token=token)
    finally:
        grow.join()
        segments.unlink(name)
        segments.cleanup_job(job)
