"""Elastic hosts: the discovery script's output, running it (each way it can fail, with
real scripts), and the blacklist with its cooldown on a fake clock."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from ddlrun.elastic_hosts import (
    Blacklist,
    DiscoveryError,
    NoHostsError,
    check_cooldown_range,
    check_script,
    parse_discovery,
    run_discovery,
)
from ddlrun.errors import UsageError


# ---------------------------------------------------------------------------- parsing
def test_parse_hosts_slots_default_comments_and_order():
    text = "# hosts\n\nb:2\n  a  \n[fe80::1]:4   # gpu box\nc:1\n"
    got = parse_discovery(text, default_slots=3, script="hosts.sh")
    assert got == {"b": 2, "a": 3, "[fe80::1]": 4, "c": 1}
    assert list(got) == ["b", "a", "[fe80::1]", "c"]


def test_parse_empty_output_is_no_hosts():
    assert parse_discovery("\n# none yet\n", default_slots=1, script="s") == {}


@pytest.mark.parametrize("text, line, problem", [
    ("a:2\nb\n", 2, "no slot count"),
    ("a:2\na:4\n", 2, "printed twice"),
    ("a:0\n", 1, "slots must be"),
    ("a:x\n", 1, "slots must be"),
    ("a:-1\n", 1, "slots must be"),
    ("ok:1\n\nbad host:2\n", 3, "invalid host name"),
    ("a;touch /tmp/x:1\n", 1, "invalid host name"),
    ("$(id):1\n", 1, "invalid host name"),
    ("`id`\n", 1, "invalid host name"),
    ("-oProxyCommand=x:1\n", 1, "invalid host name"),
    ("bob@a:1\n", 1, "no user@"),
])
def test_parse_errors_name_script_line_and_problem(text, line, problem):
    with pytest.raises(DiscoveryError) as exc:
        parse_discovery(text, default_slots=None, script="hosts.sh")
    message = str(exc.value)
    assert "\n" not in message
    assert f"hosts.sh:{line}:" in message
    assert problem in message


def test_discovery_error_is_a_usage_error():
    assert issubclass(DiscoveryError, UsageError)
    assert issubclass(NoHostsError, DiscoveryError)


# ---------------------------------------------------------------------------- running it
def _script(tmp_path: Path, body: str, name: str = "hosts.sh", mode: int = 0o755) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(mode)
    return str(path)


def test_run_discovery_reads_hosts(tmp_path):
    script = _script(tmp_path, "echo a:2\necho b\necho 'warming up' >&2\n")
    assert run_discovery(script, timeout=30, default_slots=4) == {"a": 2, "b": 4}


def test_run_discovery_relative_path_and_cwd(tmp_path):
    _script(tmp_path, "cat here.txt\n")
    (tmp_path / "here.txt").write_text("h1:1\n")
    assert run_discovery("hosts.sh", timeout=30, default_slots=None,
                         cwd=str(tmp_path)) == {"h1": 1}


def test_run_discovery_uses_no_shell(tmp_path):
    script = _script(tmp_path, "echo a:1\n", name="my hosts;touch pwned.sh")
    assert run_discovery(script, timeout=30, default_slots=None) == {"a": 1}
    assert not (tmp_path / "pwned.sh").exists()


def test_missing_script(tmp_path):
    with pytest.raises(DiscoveryError, match="no such file"):
        run_discovery(str(tmp_path / "nope.sh"), timeout=30, default_slots=1)


def test_not_executable(tmp_path):
    script = _script(tmp_path, "echo a:1\n", mode=0o644)
    with pytest.raises(DiscoveryError, match="not executable: chmod \\+x"):
        run_discovery(script, timeout=30, default_slots=1)


def test_directory_is_not_a_script(tmp_path):
    with pytest.raises(DiscoveryError, match="not a regular file"):
        check_script(str(tmp_path))


def test_check_script_gives_the_absolute_path(tmp_path):
    _script(tmp_path, "echo a:1\n")
    assert check_script("hosts.sh", cwd=str(tmp_path)) == str(tmp_path / "hosts.sh")


def test_exits_non_zero_with_code_and_last_stderr_line(tmp_path):
    script = _script(tmp_path, "echo a:1\necho first >&2\necho 'cloud API down' >&2\n"
                               "exit 3\n")
    with pytest.raises(DiscoveryError) as exc:
        run_discovery(script, timeout=30, default_slots=1)
    message = str(exc.value)
    assert "exited with code 3: cloud API down" in message
    assert "hosts.sh" in message and "\n" not in message


def test_killed_by_a_signal(tmp_path):
    script = _script(tmp_path, "kill -9 $$\n")
    with pytest.raises(DiscoveryError, match="killed by SIGKILL"):
        run_discovery(script, timeout=30, default_slots=1)


def test_no_shebang_cannot_run(tmp_path):
    path = tmp_path / "hosts.sh"
    path.write_bytes(b"\x7fELF-not-really")
    path.chmod(0o755)
    with pytest.raises(DiscoveryError, match="cannot run it"):
        run_discovery(str(path), timeout=30, default_slots=1)


def test_hang_is_killed_with_its_process_group(tmp_path):
    pidfile = tmp_path / "helper.pid"
    script = _script(tmp_path, f"sleep 600 &\necho $! > {pidfile}\necho a:1\nwait\n")
    with pytest.raises(DiscoveryError, match="did not finish in 1 s"):
        run_discovery(script, timeout=1, default_slots=1)
    helper = int(pidfile.read_text())
    assert _gone_soon(helper), f"the script's helper {helper} outlived the timeout"


def _gone_soon(pid: int) -> bool:
    """Whether ``pid`` is dead or a zombie within 30 s (its reaper may take a moment)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_malformed_output(tmp_path):
    script = _script(tmp_path, "echo a:1\necho 'b:two'\n")
    with pytest.raises(DiscoveryError, match="hosts.sh:2: slots must be a positive"):
        run_discovery(script, timeout=30, default_slots=1)


def test_shell_metacharacters_in_a_host_name(tmp_path):
    script = _script(tmp_path, "echo 'a$(touch pwned):1'\n")
    with pytest.raises(DiscoveryError, match="hosts.sh:1: invalid host name"):
        run_discovery(script, timeout=30, default_slots=1)
    assert not (tmp_path / "pwned").exists()


def test_not_utf8_names_the_line(tmp_path):
    script = _script(tmp_path, "printf 'a:1\\nh\\351t:1\\n'\n")
    with pytest.raises(DiscoveryError, match="hosts.sh:2: byte .* is not UTF-8"):
        run_discovery(script, timeout=30, default_slots=1)


def test_prints_no_host(tmp_path):
    script = _script(tmp_path, "echo '# nothing ready'\n")
    with pytest.raises(NoHostsError, match="printed no host"):
        run_discovery(script, timeout=30, default_slots=1)


def test_host_without_slots_and_no_default(tmp_path):
    script = _script(tmp_path, "echo a\n")
    with pytest.raises(DiscoveryError, match="hosts.sh:1: 'a' has no slot count.*--slots"):
        run_discovery(script, timeout=30, default_slots=None)


# ---------------------------------------------------------------------------- blacklist
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FixedJitter(random.Random):
    """``uniform`` at a fixed fraction of its range."""

    def __init__(self, fraction: float) -> None:
        super().__init__(0)
        self.fraction = fraction

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.fraction


def test_without_cooldown_a_host_is_out_for_good():
    clock = FakeClock()
    black = Blacklist(None, clock=clock)
    assert black.add("a") is None
    clock.now += 10 ** 9
    assert black.is_blacklisted("a")
    assert not black.is_blacklisted("b")
    assert black.blacklisted() == ["a"]
    assert black.filter({"b": 2, "a": 2, "c": 1}) == {"b": 2, "c": 1}


def test_cooldown_backs_off_exponentially_then_caps():
    clock = FakeClock()
    black = Blacklist((10, 100), clock=clock, rng=FixedJitter(0.5))
    expected = [10 * 2 + 5, 10 * 4 + 5, 10 * 8 + 5, 100, 100]  # MIN*2**n + jitter, <= MAX
    for delay in expected:
        assert black.add("a") == pytest.approx(delay)
        assert black.is_blacklisted("a")
        clock.now += delay - 0.001
        assert black.is_blacklisted("a") and black.blacklisted() == ["a"]
        clock.now += 0.002
        assert not black.is_blacklisted("a")
        assert black.filter({"a": 1}) == {"a": 1}
    assert black.failures("a") == len(expected)


def test_failure_during_a_cooldown_does_not_extend_it():
    clock = FakeClock()
    black = Blacklist((10, 1000), clock=clock, rng=FixedJitter(0.0))
    assert black.add("a") == pytest.approx(20)
    clock.now += 15
    assert black.add("a") == pytest.approx(5)  # the host's other ranks failing too
    assert black.failures("a") == 1
    clock.now += 5.001
    assert not black.is_blacklisted("a")
    assert black.add("a") == pytest.approx(40)


def test_jitter_stays_within_min_and_max():
    clock = FakeClock()
    black = Blacklist((1, 5), clock=clock, rng=random.Random(7))
    for _ in range(50):
        delay = black.add("h")
        assert delay is not None and 1 <= delay <= 5
        clock.now += delay + 1


def test_hosts_cool_down_independently_and_list_in_order():
    clock = FakeClock()
    black = Blacklist((10, 1000), clock=clock, rng=FixedJitter(0.0))
    black.add("b")
    clock.now += 10
    black.add("a")
    assert black.blacklisted() == ["b", "a"]
    clock.now += 10.5  # b's 20 s are over, a has 9.5 s left
    assert black.blacklisted() == ["a"]
    assert black.filter({"a": 1, "b": 2}) == {"b": 2}


@pytest.mark.parametrize("bad", [(0.5, 10), (10, 5), (1, 3601)])
def test_cooldown_range_is_checked(bad):
    with pytest.raises(UsageError, match="--blacklist-cooldown-range"):
        Blacklist(bad)
    with pytest.raises(UsageError):
        check_cooldown_range(bad)


def test_run_discovery_leaves_no_child(tmp_path):
    script = _script(tmp_path, "echo a:1\n")
    before = set(os.listdir("/proc"))
    run_discovery(script, timeout=30, default_slots=1)
    children = [p for p in set(os.listdir("/proc")) - before if p.isdigit()
                and _parent(p) == os.getpid()]
    assert children == []


def _parent(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None
