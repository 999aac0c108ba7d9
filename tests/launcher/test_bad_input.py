"""Bad input ends ddlrun in one clear line and loses nothing (issue 28): ddl's settings
checked by ddl's own rules before any rank starts, hostfiles that are not ASCII counts or
UTF-8, a Ctrl-C while hosts are probed, and a port that is only in TIME_WAIT."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time

import pytest
from ddlrun_testlib import PY, ddlrun_argv, procs_with, run_ddlrun, wait_gone

from ddlrun.preflight import pick_free_pair, port_free

NEVER = [PY, "-c", "raise SystemExit(7)"]  # exit 7 would show the program ran


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("ddlrun: error:")]
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.parametrize("args,env,says", [
    (["-n", "2", "-x", "DDL_PORT=70000"], {},
     "DDL_PORT='70000' is out of range (allowed: 1..65535); the ranks would get it from -x"),
    (["-n", "2"], {"DDL_TIMEOUT": "nan"},
     "DDL_TIMEOUT='nan' is invalid: expected a number, got 'nan' (allowed: 0.001..604800 "
     "seconds); the ranks would get it from ddlrun's environment"),
    (["-n", "2", "-x", "DDL_TIMEOUT=0"], {}, "DDL_TIMEOUT='0' is out of range"),
    (["-n", "2", "-x", "DDL_SHM_HEAP_BYTES=1e30"], {},
     "DDL_SHM_HEAP_BYTES='1e30' is out of range (allowed: 1M..1P bytes)"),
    (["-n", "2", "-x", "DDL_SHM_SLOT_BYTES=1K"], {},
     "DDL_SHM_SLOT_BYTES='1K' is out of range (allowed: 64K..1P bytes)"),
    # checked against the plan: 2 ranks on the host need 2 x 2 x 64K of staging
    (["-n", "2", "-x", "DDL_SHM_MAX_BYTES=128K"], {},
     "DDL_SHM_MAX_BYTES=128K leaves 32768 bytes of staging per rank and parity for 2 ranks"),
    (["-n", "1", "--master-port", "65535"], {},
     "--master-port 65535: MASTER_PORT=65535 leaves no port for ddl's store"),
    (["-H", "localhost:100000000000", "--dry-run"], {},
     "-H: slots must be 1..4096 per host, got 100000000000"),
    (["-n", "1", "--timeout", "nan"], {},
     "--timeout must be a positive number of seconds, got nan"),
    (["-n", "1", "--grace", "inf"], {}, "--grace must be 0 or more seconds, got inf"),
])
def test_a_bad_setting_is_one_line_and_no_rank_starts(args, env, says):
    t0 = time.monotonic()
    res = run_ddlrun(*args, *NEVER, env={**os.environ, **env})
    assert says in _one_error_line(res)
    assert time.monotonic() - t0 < 30


def test_a_hostfile_that_is_not_utf8_or_has_a_foreign_digit_is_one_line(tmp_path):
    latin1 = tmp_path / "latin1"
    latin1.write_bytes(b"localhost slots=1\nh\xf6st slots=1\n")
    line = _one_error_line(run_ddlrun("--hostfile", str(latin1), "--dry-run", *NEVER))
    assert f"{latin1}:2: byte b'\\xf6' is not UTF-8" in line
    digit = tmp_path / "digit"
    digit.write_text("localhost slots=\u00b2\n", encoding="utf-8")
    line = _one_error_line(run_ddlrun("--hostfile", str(digit), "--dry-run", *NEVER))
    assert f"{digit}:1: slots must be a positive integer, got '\u00b2'" in line


def test_ctrl_c_while_hosts_are_probed_stops_with_130_and_kills_the_probes(tmp_path, marker):
    """Used to end in a traceback, with the ssh probes left running."""
    started = tmp_path / "started"
    ssh = tmp_path / "ssh"  # a host that never answers the probe
    ssh.write_text(f"#!/bin/sh\ntouch {started}\n"
                   f"exec {PY} -c 'import time; time.sleep(60)' {marker}\n")
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(ddlrun_argv("-H", "unanswering-host:1", *NEVER), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not (started.exists() and procs_with(marker)) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert procs_with(marker), "the probe never started"
        proc.send_signal(2)  # SIGINT
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 130, err
        assert "Traceback" not in err, err
        assert "ddlrun: SIGINT: stopped during the preflight; no rank was started" in err
        assert wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _time_wait_port() -> int:
    """A port whose only socket is in TIME_WAIT, as right after a job's store closed."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
    conn.close()  # the listening side closes first: its end waits in TIME_WAIT
    time.sleep(0.05)
    cli.close()
    time.sleep(0.05)
    return port


def test_a_port_in_time_wait_passes_preflight_and_one_listened_on_fails():
    """A rerun with the same --master-port within a minute failed: the check bound without
    SO_REUSEADDR, which ddl's store sets."""
    port = _time_wait_port()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("", port))  # what the check did
    assert port_free(port)
    master = pick_free_pair(avoid=[port])
    res = run_ddlrun("--check", "--master-port", str(master), "-x", f"DDL_PORT={port}")
    assert res.returncode == 0, res.stderr
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert not port_free(busy)
        res = run_ddlrun("--check", "--master-port", str(master), "-x", f"DDL_PORT={busy}")
    assert res.returncode == 3, res.stderr
    assert f"ddl's store port {busy} (DDL_PORT, default MASTER_PORT+1) is in use" in res.stderr
