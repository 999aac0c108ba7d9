"""ddlrun's elastic driver on one host (Horovod's ``--min-np/--max-np
--host-discovery-script``), with real processes: the job script (scripts/elastic_steps.py)
adds, at every step, the allreduced sum of (rank + 1) over the ranks of its world, so its
RESULT tells exactly which world size every committed step had and the value must equal
the sum those sizes give. A lost worker (a signal, a non-zero exit), two losses, hosts
added and removed by a discovery script, a cooldown that brings a slot back, the end below
--min-np or past --reset-limit; after each, nothing is left behind (processes, shared
memory of any world, empty flight-recorder folders). Bad input is one line and starts
nothing; a job without elastic flags fails as it always did."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from ddlrun_testlib import HERE, PY, run_ddlrun, shm_left, wait_gone

from ddlrun.diagnose import flight_folder
from ddlrun.elastic_run import world_job_id

STEPS = str(HERE / "scripts" / "elastic_steps.py")
HOSTS = str(HERE / "scripts" / "elastic_hosts.sh")


# ---------------------------------------------------------------------------- helpers
def result(stdout: str) -> dict:
    """Rank 0's RESULT line."""
    lines = [ln.partition("RESULT ")[2] for ln in stdout.splitlines() if "RESULT " in ln]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


def value_of(sizes: list[int]) -> float:
    """What elastic_steps.py adds up over steps run in worlds of these sizes."""
    return float(sum(s * (s + 1) // 2 for s in sizes))


def check_result(stdout: str, steps: int, sizes: list[int]) -> dict:
    res = result(stdout)
    assert res["steps"] == steps
    assert res["sizes"] == sizes, res
    assert res["value"] == [value_of(sizes)] * 5, res
    return res


def notes(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("ddlrun: ")]


_WORLDS = 6  # more worlds than any test here forms


@pytest.fixture
def job(marker):
    """A job id of this test's own; the flight-recorder folders of its worlds are removed
    afterwards, whatever the outcome (the dumps the survivors of a loss write are the
    user's, but not this test's)."""
    job_id = f"el_{marker[-8:]}"
    yield job_id
    for g in range(_WORLDS):
        shutil.rmtree(flight_folder(world_job_id(job_id, g)), ignore_errors=True)


def assert_clean(job: str, marker: str, worlds: int) -> None:
    """No process of the job, no shared memory of any of its worlds (and of the next
    ones), no empty flight-recorder folder (nor a rank's marker file) in any of them."""
    assert wait_gone(marker) == []
    assert worlds + 2 <= _WORLDS
    for g in range(worlds + 2):
        job_id = world_job_id(job, g)
        assert shm_left(job_id) == [], job_id
        folder = flight_folder(job_id)
        if os.path.isdir(folder):
            left = os.listdir(folder)
            assert left, f"{folder} was left empty"
            assert not [n for n in left if n.endswith(".pid")], left


def elastic(job: str, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return run_ddlrun("--job-id", job, *args, timeout=timeout, **kw)


def discovery(tmp_path: Path, *outputs: str) -> str:
    """A discovery script printing ``outputs[i]`` on its i-th run, the last one from then
    on (scripts/elastic_hosts.sh with its plan in a folder of its own)."""
    folder = tmp_path / "hosts"
    folder.mkdir()
    for i, text in enumerate(outputs):
        (folder / str(i)).write_text(text + "\n")
    script = tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(HOSTS)} {shlex.quote(str(folder))}\n")
    script.chmod(0o755)
    return str(script)


# ---------------------------------------------------------------------------- a lost worker
@pytest.mark.parametrize("how,words,letters", [
    (["kill", "localhost:1", "7"], "was killed by SIGKILL", "r"),
    # the mode letters keep their meaning in the new world, the grid fits its size
    (["exit", "localhost:1", "7", "3"], "exited with code 3", "b"),
], ids=["sigkill", "exit-3-mode-b"])
def test_a_lost_worker_the_job_goes_on_from_the_last_commit(job, marker, how, words,
                                                            letters):
    mode = ["--mode", letters] if letters != "r" else []
    res = elastic(job, "-np", "3", "--min-np", "2", "--max-np", "3", *mode, PY, STEPS, "12",
                  "3", *how, marker)
    assert res.returncode == 0, res.stdout + res.stderr
    # commits at steps 3 and 6; step 7 is lost with the worker and runs again in world 1
    check_result(res.stdout, 12, [3] * 6 + [2] * 6)
    assert notes(res.stderr) == [
        f"ddlrun: world 0 (start): 3 ranks on 1 host (localhost:3), DDL_OPTIONS "
        f"'-mode {letters}:3'",
        f"ddlrun: worker localhost:1 (rank 1 of world 0) failed ({words}); re-forming the "
        "world",
        "ddlrun: world 1 (a worker was lost): 2 ranks on 1 host (localhost:2), DDL_OPTIONS "
        f"'-mode {letters}:2'",
        "ddlrun: world 1 goes on from commit 2 (restored)",
    ], res.stderr
    assert_clean(job, marker, 1)


def test_two_losses_two_new_worlds(job, marker):
    res = elastic(job, "-np", "4", "--min-np", "2", "--max-np", "4", PY, STEPS, "12", "2",
                  "kill", "localhost:3", "3", "exit", "localhost:1", "7", "5", marker)
    assert res.returncode == 0, res.stdout + res.stderr
    # 4 ranks for steps 1-2 (step 3 lost), 3 ranks for 3-6 (step 7 lost), then 2 ranks
    check_result(res.stdout, 12, [4] * 2 + [3] * 4 + [2] * 6)
    err = res.stderr
    assert "ddlrun: worker localhost:3 (rank 3 of world 0) failed (was killed by SIGKILL)" \
        in err
    assert "ddlrun: world 1 (a worker was lost): 3 ranks on 1 host (localhost:3)" in err
    assert "ddlrun: world 1 goes on from commit 1 (restored)" in err
    assert "ddlrun: worker localhost:1 (rank 1 of world 1) failed (exited with code 5)" in err
    assert "ddlrun: world 2 (a worker was lost): 2 ranks on 1 host (localhost:2)" in err
    assert "ddlrun: world 2 goes on from commit 3 (restored)" in err
    assert_clean(job, marker, 2)


# ---------------------------------------------------------------------------- discovery
def stamps(tmp_path: Path, worker: str) -> list[dict]:
    path = tmp_path / f"stamp.{worker}"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def split_sizes(sizes: list[int], before: int, after: int, commit: int) -> int:
    """The step at which ``sizes`` changes from ``before`` to ``after`` (once, at a commit)."""
    k = sizes.index(after)
    assert sizes == [before] * k + [after] * (len(sizes) - k), sizes
    assert k > 0 and k % commit == 0, sizes
    return k


def test_hosts_added_by_discovery_join_at_the_next_commit(job, marker, tmp_path):
    script = discovery(tmp_path, "localhost:2", "localhost:2", "localhost:3")
    res = elastic(job, "--host-discovery-script", script, "--discovery-interval", "0.5",
                  "-np", "2", "--min-np", "1", "--max-np", "3", PY, STEPS, "14", "2",
                  "sleep", "0.2", "stamp", str(tmp_path / "stamp"), marker, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    sizes = result(res.stdout)["sizes"]
    k = split_sizes(sizes, 2, 3, 2)
    check_result(res.stdout, 14, sizes)
    # the new worker got the state: its first step is the one after the commit it joined at
    new = stamps(tmp_path, "localhost:2")
    assert [s["step"] for s in new] == list(range(k + 1, 15)), new
    assert {s["size"] for s in new} == {3}
    err = notes(res.stderr)
    # the workers keep their state (HostsUpdatedInterrupt): nothing is restored
    assert err == [
        "ddlrun: world 0 (start): 2 ranks on 1 host (localhost:2), DDL_OPTIONS '-mode r:2'",
        "ddlrun: host localhost has 3 slot(s) now (discovery)",
        "ddlrun: world 1 (hosts changed): 3 ranks on 1 host (localhost:3), DDL_OPTIONS "
        "'-mode r:3'",
    ], res.stderr
    assert_clean(job, marker, 1)


def test_a_world_superseded_before_it_formed_restarts_its_new_workers(job, marker,
                                                                     tmp_path):
    """Discovery adds a slot (world 1 is announced; its new worker waits in init for the
    others, who move at their next commit), then a worker fails before that commit:
    world 2 supersedes world 1, whose new worker never joined it. It holds no state, so
    ddlrun restarts it into world 2 instead of leaving it waiting for world 1's
    rendezvous (which would hold world 2 up until --elastic-timeout)."""
    script = discovery(tmp_path, "localhost:2", "localhost:2", "localhost:3")
    res = elastic(job, "--host-discovery-script", script, "--discovery-interval", "0.5",
                  "--elastic-timeout", "30", "-np", "2", "--min-np", "1", "--max-np", "3",
                  PY, STEPS, "10", "8", "sleep", "0.5", "exit", "localhost:1", "7", "3",
                  marker, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    # no commit before the loss: world 2 (localhost:0 and a new localhost:2) starts over
    check_result(res.stdout, 10, [2] * 10)
    err = notes(res.stderr)
    assert err[:3] == [
        "ddlrun: world 0 (start): 2 ranks on 1 host (localhost:2), DDL_OPTIONS '-mode r:2'",
        "ddlrun: host localhost has 3 slot(s) now (discovery)",
        "ddlrun: world 1 (hosts changed): 3 ranks on 1 host (localhost:3), DDL_OPTIONS "
        "'-mode r:3'",
    ], res.stderr
    assert "ddlrun: worker localhost:1 (rank 1 of world 1) failed (exited with code 3); " \
        "re-forming the world" in err, res.stderr
    assert "ddlrun: world 1 did not form: restarting its new workers localhost:2 in the " \
        "next" in err, res.stderr
    assert "ddlrun: world 2 (a worker was lost): 2 ranks on 1 host (localhost:2), " \
        "DDL_OPTIONS '-mode r:2'" in err, res.stderr
    assert_clean(job, marker, 2)


def test_a_worker_that_finishes_first_ends_the_job_as_a_success(job, marker):
    """Horovod's rule: once a worker has succeeded the job is done; the others (whose peer
    left) are stopped after a grace, and the job's code is 0. Before: they waited for a
    next world that never came, forever."""
    t0 = time.monotonic()
    res = elastic(job, "-np", "3", "--min-np", "2", "--max-np", "3", "--elastic-timeout", "5",
                  PY, STEPS, "10", "2", "exit", "localhost:1", "5", "0", marker, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ddlrun: a worker finished; stopping those still running (localhost:0, " \
        "localhost:2)" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 60
    assert_clean(job, marker, 0)


def test_a_world_without_a_worker_of_the_last_one_ends_the_job(job, marker, tmp_path):
    """Discovery swaps every host that had workers for a new one: the next world would
    start from nothing (its rank 0 a new worker), so the job ends, naming why."""
    script = discovery(tmp_path, "localhost:2", "localhost:2", "127.0.0.1:2")
    res = elastic(job, "--host-discovery-script", script, "--discovery-interval", "0.5",
                  "-np", "2", "--min-np", "2", "--max-np", "2", PY, STEPS, "40", "2", "sleep",
                  "0.3", marker, cwd=tmp_path, timeout=90)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "RESULT" not in res.stdout
    assert "ddlrun: the next world would have no worker of the last one (the hosts that had " \
        "them are gone): the state would be lost; ending" in res.stderr, res.stderr
    assert_clean(job, marker, 0)


def test_a_stuck_worker_is_stopped_when_the_others_time_out_and_leave(job, marker):
    """A worker hangs (no exit): its peers' collective times out (DDL_TIMEOUT), they restore
    and leave the world although ddlrun formed no other; ddlrun sees it, stops the worker
    that did not leave (stuck), blacklists its slot and forms the next world."""
    res = elastic(job, "-np", "3", "--min-np", "2", "--max-np", "3", "-x", "DDL_TIMEOUT=3",
                  PY, STEPS, "10", "2", "hang", "localhost:1", "5", marker, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # the hang is after step 5's allreduce; step 6's times out; commit 2 (step 4) restored
    check_result(res.stdout, 10, [3] * 4 + [2] * 6)
    assert "ddlrun: worker(s) localhost:1 of world 0 did not leave it with the others " \
        "(stuck?): stopped; re-forming the world" in res.stderr, res.stderr
    assert "ddlrun: world 1 (a worker was stuck): 2 ranks on 1 host (localhost:2), " \
        "DDL_OPTIONS '-mode r:2'" in res.stderr, res.stderr
    assert_clean(job, marker, 1)


def test_slots_removed_by_discovery_the_worker_leaves(job, marker, tmp_path):
    script = discovery(tmp_path, "localhost:3", "localhost:3", "localhost:2")
    # each worker's exit code in code.<worker>: the one that leaves must end with 0
    job_script = (f'"{PY}" "{STEPS}" 14 2 sleep 0.2 stamp "{tmp_path}/stamp" {marker}; c=$?; '
                  f'echo $c > "{tmp_path}/code.$DDL_ELASTIC_WORKER"; exit $c')
    res = elastic(job, "--host-discovery-script", script, "--discovery-interval", "0.5",
                  "-np", "3", "--min-np", "1", "--max-np", "3", "/bin/sh", "-c", job_script,
                  cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    sizes = result(res.stdout)["sizes"]
    k = split_sizes(sizes, 3, 2, 2)
    check_result(res.stdout, 14, sizes)
    gone = stamps(tmp_path, "localhost:2")
    assert [s["step"] for s in gone] == list(range(1, k + 1)), gone
    codes = {w: (tmp_path / f"code.localhost:{w}").read_text().strip() for w in range(3)}
    assert codes == {0: "0", 1: "0", 2: "0"}
    err = notes(res.stderr)
    assert "ddlrun: host localhost has 2 slot(s) now (discovery)" in err
    assert "ddlrun: world 1 (hosts changed): 2 ranks on 1 host (localhost:2), DDL_OPTIONS " \
        "'-mode r:2'" in err
    assert "ddlrun: worker localhost:2 left: no place in world 1" in err, err
    assert not [ln for ln in err if "failed" in ln], err
    assert_clean(job, marker, 1)


# ---------------------------------------------------------------------------- the end
@pytest.mark.parametrize("how,code,words", [
    (["exit", "localhost:1", "5", "3"], 3, "exited with code 3"),
    (["kill", "localhost:1", "5"], 137, "was killed by SIGKILL"),
], ids=["exit-3", "sigkill"])
def test_below_min_np_the_job_ends_at_once_with_the_workers_code(job, marker, tmp_path, how,
                                                                 code, words):
    res = elastic(job, "-np", "2", "--min-np", "2", PY, STEPS, "2000", "2", "sleep", "0.01",
                  "stamp", str(tmp_path / "stamp"), *how, marker)
    ended = time.time()
    assert res.returncode == code, res.stdout + res.stderr
    assert notes(res.stderr)[-2:] == [
        f"ddlrun: worker localhost:1 (rank 1 of world 0) failed ({words}); re-forming the "
        "world",
        f"ddlrun: 1 worker(s) left, fewer than --min-np 2: ending; lost: localhost:1 ({words})",
    ], res.stderr
    # the worker wrote its stamp for step 5 just before it went; not a benchmark: the
    # bound is the (the detection timeout plus 5 s), generously
    failed_at = (tmp_path / "stamp.localhost:1").stat().st_mtime
    assert ended - failed_at < 20
    assert "RESULT" not in res.stdout
    assert_clean(job, marker, 0)


def test_reset_limit_0_the_first_loss_ends_the_job(job, marker):
    res = elastic(job, "-np", "3", "--min-np", "2", "--reset-limit", "0", PY, STEPS, "12",
                  "3", "exit", "localhost:2", "4", "6", marker)
    assert res.returncode == 6, res.stdout + res.stderr
    assert notes(res.stderr)[-2:] == [
        "ddlrun: worker localhost:2 (rank 2 of world 0) failed (exited with code 6); "
        "re-forming the world",
        "ddlrun: the world was re-formed 0 time(s) (--reset-limit 0): ending",
    ], res.stderr
    assert "world 1" not in res.stderr and "RESULT" not in res.stdout
    assert_clean(job, marker, 0)


# ---------------------------------------------------------------------------- cooldown
@pytest.mark.slow
@pytest.mark.parametrize("with_script", [False, True], ids=["fixed-hosts", "discovery"])
def test_a_failed_slot_comes_back_after_its_cooldown(job, marker, tmp_path, with_script):
    hosts = (["--host-discovery-script", discovery(tmp_path, "localhost:3"),
              "--discovery-interval", "0.5"] if with_script else [])
    res = elastic(job, *hosts, "-np", "3", "--min-np", "2", "--max-np", "3",
                  "--blacklist-cooldown-range", "1", "1", PY, STEPS, "24", "2", "sleep", "0.25",
                  "stamp", str(tmp_path / "stamp"), "kill", "localhost:1", "3", marker,
                  cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    sizes = result(res.stdout)["sizes"]
    # 3 ranks for steps 1-2 (step 3 lost), 2 ranks, then 3 again from a later commit
    back = sizes.index(3, 2)
    assert sizes == [3, 3] + [2] * (back - 2) + [3] * (24 - back), sizes
    assert back > 2 and back % 2 == 0, sizes
    check_result(res.stdout, 24, sizes)
    # the slot's new worker got the state: steps 1-3 are the lost worker's, then it goes on
    steps = [s["step"] for s in stamps(tmp_path, "localhost:1")]
    assert steps == [1, 2, 3] + list(range(back + 1, 25)), steps
    err = notes(res.stderr)
    assert "ddlrun: world 1 (a worker was lost): 2 ranks on 1 host (localhost:2), " \
        "DDL_OPTIONS '-mode r:2'" in err
    assert [ln for ln in err if ln.startswith("ddlrun: world 2 (")
            and ": 3 ranks on 1 host (localhost:3)" in ln], err
    assert_clean(job, marker, 2)


# ---------------------------------------------------------------------------- bad input
def _script(tmp_path: Path, body: str, mode: int = 0o755) -> str:
    path = tmp_path / "hosts.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return str(path)


def _refused(tmp_path: Path, *args: str) -> str:
    """Run ddlrun with ``args`` and a program that would leave a file: rc 2, one line on
    stderr (returned), and the program never started."""
    made = tmp_path / "started"
    res = run_ddlrun(*args, PY, "-c", f"open({str(made)!r}, 'w')", timeout=60, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert not made.exists()
    return lines[0]


def test_a_missing_discovery_script(tmp_path):
    line = _refused(tmp_path, "--host-discovery-script", "./nope.sh", "-np", "2")
    assert line == f"ddlrun: error: discovery script {tmp_path}/nope.sh: no such file " \
        f"({tmp_path}/nope.sh)"


def test_a_discovery_script_that_is_not_executable(tmp_path):
    path = _script(tmp_path, "echo localhost:2", mode=stat.S_IRUSR | stat.S_IWUSR)
    line = _refused(tmp_path, "--host-discovery-script", path, "-np", "2")
    assert line == f"ddlrun: error: discovery script {path}: not executable: chmod +x {path}"


def test_a_discovery_script_that_fails(tmp_path):
    path = _script(tmp_path, "echo 'no cluster here' >&2; exit 4")
    line = _refused(tmp_path, "--host-discovery-script", path, "-np", "2")
    assert line == f"ddlrun: error: discovery script {path} exited with code 4: no cluster here"


@pytest.mark.parametrize("printed,words", [
    ("localhost:x", ":1: slots must be a positive integer, got 'x'"),
    ("localhost:2\nlocalhost:1", ":2: host 'localhost' is printed twice"),
    ("me@localhost:2", "no user@"),
    ("-oProxyCommand=x:2", "-oProxyCommand"),
])
def test_a_discovery_script_that_prints_bad_lines(tmp_path, printed, words):
    path = _script(tmp_path, f"cat <<'EOF'\n{printed}\nEOF")
    line = _refused(tmp_path, "--host-discovery-script", path, "-np", "2")
    assert line.startswith(f"ddlrun: error: discovery script {path}:"), line
    assert words in line, line


def test_a_discovery_script_printing_a_host_without_slots_needs_slots(tmp_path):
    path = _script(tmp_path, "echo localhost")
    line = _refused(tmp_path, "--host-discovery-script", path, "-np", "2")
    assert line == f"ddlrun: error: discovery script {path}:1: 'localhost' has no slot count: " \
        "print localhost:N or give ddlrun --slots N"


@pytest.mark.slow
def test_a_discovery_script_that_hangs_is_killed(tmp_path, marker):
    # no flag sets the discovery timeout (Elastic.discovery_timeout, 10 s) yet
    path = _script(tmp_path, f'"{PY}" -c "import time; time.sleep(60)" {marker}')
    line = _refused(tmp_path, "--host-discovery-script", path, "-np", "2")
    assert line == f"ddlrun: error: discovery script {path} did not finish in 10 s: it was " \
        "killed (it must print the hosts and exit)"
    assert wait_gone(marker) == []


@pytest.mark.parametrize("args,text", [
    (["--min-np", "4", "--max-np", "2"], "--min-np 4 is greater than --max-np 2"),
    # --min-np, never given, is -np's default: the line names what the user typed
    (["-np", "5", "--max-np", "4"], "-np 5 is greater than --max-np 4"),
    (["-np", "2", "--slots", "2"],
     "--slots is for elastic jobs: give --min-np/--max-np or --host-discovery-script too"),
    (["-np", "2", "--reset-limit", "1"],
     "--reset-limit is for elastic jobs: give --min-np/--max-np or --host-discovery-script "
     "too"),
    (["--nnodes", "4:2"], "--nnodes 4:2: MIN 4 is greater than MAX 2"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "5", "1"],
     "--blacklist-cooldown-range 5 1: need 1 <= MIN <= MAX <= 3600 seconds"),
    # a grid of its own fixes the number of ranks, which an elastic world changes
    (["-np", "3", "--min-np", "2", "--mode", "r:3"],
     "-mode r:3 fixes the grid, but the world of a job with --min-np/--max-np changes size: "
     "give the mode letters only (--mode r); ddlrun fits the grid to each world"),
    (["-np", "3", "--max-np", "4", "--ddloption", "-mode b:3 -dbg 0"],
     "-mode b:3 fixes the grid, but the world of a job with --min-np/--max-np changes size: "
     "give the mode letters only (--mode b); ddlrun fits the grid to each world"),
    (["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29999",
      "-x", "DDL_OPTIONS=-mode r:2"],
     "-mode r:2 fixes the grid, but the world of a job with --nnodes MIN:MAX changes size: "
     "give the mode letters only (--mode r); ddlrun fits the grid to each world"),
    (["-np", "2", "--min-np", "1", "--max-restarts", "2"],
     "--max-restarts restarts every rank (torchrun's way); elastic flags re-form the world "
     "in place (Horovod's): give one or the other"),
])
def test_bad_elastic_flags_are_one_usage_line(tmp_path, args, text):
    assert _refused(tmp_path, *args) == f"ddlrun: error: {text}"


@pytest.mark.parametrize("args,where", [
    (["--launcher", "mpirun", "-n", "2"], "--launcher mpirun"),
    (["--launcher", "slurm", "-n", "2"], "--launcher slurm"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"],
     "one ddlrun per node (--nnodes/--node-rank)"),
])
def test_elastic_where_ddlrun_does_not_start_the_workers_is_refused(tmp_path, args, where):
    line = _refused(tmp_path, *args, "--min-np", "1")
    assert line.startswith("ddlrun: error: elastic training (--min-np/--max-np/"
                           f"--host-discovery-script) is not supported with {where} yet"), line


def test_nnodes_as_a_range_needs_the_rendezvous_endpoint(tmp_path):
    # the range itself runs (tests/launcher/test_node_elastic.py): one ddlrun per node
    line = _refused(tmp_path, "--nnodes", "2:4")
    assert line == ("ddlrun: error: --nnodes without -H runs one ddlrun per node: give "
                    "--rdzv-endpoint HOST[:PORT] or --master-addr, the same on every node "
                    "(node 0's address; with --nnodes MIN:MAX or --max-restarts the node "
                    "whose ddlrun serves the rendezvous)"), line


# ---------------------------------------------------------------------------- not elastic
def test_without_elastic_flags_a_failing_rank_still_ends_the_job(job, marker):
    res = run_ddlrun("--job-id", job, "-np", "3", PY, str(HERE / "scripts" / "crash.py"),
                     "numpy", "1", "3", marker, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "failed: ValueError: boom on rank 1" in res.stderr
    assert f"job {job} ended with exit code 1" in res.stderr
    assert not [ln for ln in notes(res.stderr) if "world" in ln or "re-form" in ln], res.stderr
    assert_clean(job, marker, 0)


def test_without_elastic_flags_an_elastic_script_runs_as_a_fixed_job(job, marker):
    res = run_ddlrun("--job-id", job, "-np", "2", PY, STEPS, "6", "2", marker, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    check_result(res.stdout, 6, [2] * 6)
    assert notes(res.stderr) == [], res.stderr
    assert_clean(job, marker, 0)
