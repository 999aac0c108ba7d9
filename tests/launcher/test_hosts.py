"""Host lists, hostfiles, Slurm node lists, LSF variables, and validation."""

import pytest

from ddlrun.errors import UsageError
from ddlrun.hosts import (
    HostSpec,
    detect_allocation,
    expand_nodelist,
    expand_tasks_per_node,
    lsf_hosts,
    parse_host_list,
    parse_hostfile,
    parse_lsb_mcpu_hosts,
    slurm_hosts,
)


def test_host_list_with_slots_users_and_ipv6():
    assert parse_host_list("h1:4,bob@h2:2,h3,[fe80::1]:2") == (
        HostSpec("h1", 4),
        HostSpec("h2", 2, "bob"),
        HostSpec("h3", None),
        HostSpec("[fe80::1]", 2),
    )


@pytest.mark.parametrize(
    "bad",
    [
        "-oProxyCommand=touch /tmp/x",
        "a;touch /tmp/x",
        "h1:0",
        "h1:x",
        "$(id)",
        "h`id`",
        "a b",
        "h1,,h2",
        "-h",
        "evil user@h1",
        "-l@h1",
        "h1,h1",
    ],
)
def test_host_list_rejects_injection_and_nonsense(bad):
    with pytest.raises(UsageError):
        parse_host_list(bad)


def test_hostfile_formats_comments_blank_lines():
    lines = ["# cluster", "", "h1 slots=4", "h2:2   # comment", "  h3  ",
             "root@h4 slots=1 max_slots=8"]
    assert parse_hostfile(lines) == (
        HostSpec("h1", 4),
        HostSpec("h2", 2),
        HostSpec("h3"),
        HostSpec("h4", 1, "root"),
    )


@pytest.mark.parametrize(
    "lines,lineno",
    [
        (["h1 slots=2", "a;touch /tmp/x"], 2),
        (["h1", "", "h2 slots=zero"], 3),
        (["h1 cpus=2"], 1),
        (["# x", "-oProxyCommand=x"], 2),
        (["h1 slots=2 slots=3"], 1),
    ],
)
def test_hostfile_errors_name_file_and_line(lines, lineno):
    with pytest.raises(UsageError, match=rf"^hosts:{lineno}: "):
        parse_hostfile(lines, "hosts")


def test_hostfile_empty_and_duplicates():
    with pytest.raises(UsageError, match="no hosts"):
        parse_hostfile(["# nothing", ""], "hosts")
    with pytest.raises(UsageError, match="listed twice"):
        parse_hostfile(["h1", "h1 slots=2"], "hosts")


def test_slurm_nodelist_expansion():
    assert expand_nodelist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand_nodelist("a1,b[8-10],c") == ["a1", "b8", "b9", "b10", "c"]
    assert expand_nodelist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_nodelist("gpu[009-011]") == ["gpu009", "gpu010", "gpu011"]
    for bad in ("node[01-04", "node[4-1]", "node[a-b]", "x;y"):
        with pytest.raises(UsageError):
            expand_nodelist(bad)


def test_slurm_tasks_per_node_and_hosts():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert slurm_hosts(env) == (HostSpec("n1", 4), HostSpec("n2", 4))
    assert detect_allocation(env) == "slurm"
    assert slurm_hosts({"SLURM_JOB_NODELIST": "n[1-2]"}) == (HostSpec("n1"), HostSpec("n2"))


def test_lsf_hosts_from_mcpu_and_hostfile():
    assert parse_lsb_mcpu_hosts("hA 4 hB 2") == (HostSpec("hA", 4), HostSpec("hB", 2))
    with pytest.raises(UsageError):
        parse_lsb_mcpu_hosts("hA 4 hB")
    env = {"LSB_JOBID": "1", "LSB_DJOB_HOSTFILE": "/x/hosts"}
    got = lsf_hosts(env, read_lines=lambda path: ["hA", "hA", "hB", "hB", ""])
    assert got == (HostSpec("hA", 2), HostSpec("hB", 2))
    assert detect_allocation(env) == "lsf"
    with pytest.raises(UsageError, match=r"/x/hosts:2"):
        lsf_hosts(env, read_lines=lambda path: ["hA", "h;B"])
    assert detect_allocation({}) is None


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("lines,says", [
    (["h1 slots=\u00b2"], "slots must be a positive integer, got '\u00b2'"),  # isdigit() took it
    (["h1:\u0663"], "slots must be a positive integer"),  # an Arabic-Indic 3 (int() took it)
    (["h1 slots=100000000000"], "slots must be 1..4096 per host, got 100000000000"),
    (["h1 max_slots=\u00b2"], "slots must be a positive integer"),
])
def test_hostfile_counts_are_ascii_and_capped(lines, says):
    with pytest.raises(UsageError, match=rf"^hosts:1: {says}"):
        parse_hostfile(lines, "hosts")


def test_slots_over_the_cap_fail_at_once():
    """-H localhost:100000000000 --dry-run used to end in MemoryError after 18 s."""
    from ddlrun.hosts import MAX_SLOTS

    assert parse_host_list(f"h1:{MAX_SLOTS}") == (HostSpec("h1", MAX_SLOTS),)
    with pytest.raises(UsageError, match=rf"-H: slots must be 1..{MAX_SLOTS} per host"):
        parse_host_list("localhost:100000000000")
    with pytest.raises(UsageError, match="counts more than"):
        expand_tasks_per_node("1(x100000000000)")
    with pytest.raises(UsageError, match="expands to 100000000000 hosts"):
        expand_nodelist("n[1-100000000000]")
    with pytest.raises(UsageError, match="expands to 4000000 hosts"):
        expand_nodelist("r[1-2000]n[1-2000]")
    with pytest.raises(UsageError, match="slots must be 1..4096"):
        slurm_hosts({"SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "100000"})


def test_a_hostfile_that_is_not_utf8_is_one_line_with_its_line(tmp_path):
    from ddlrun.hosts import read_text_lines

    path = tmp_path / "hosts"
    path.write_bytes(b"h1 slots=2\nh\xe9 slots=2\n")  # Latin-1
    with pytest.raises(UsageError, match=rf"^--hostfile {path}:2: byte b'\\xe9' is not UTF-8"):
        read_text_lines(str(path), "--hostfile")
    with pytest.raises(UsageError, match="cannot read --hostfile"):
        read_text_lines(str(tmp_path / "missing"), "--hostfile")


@pytest.mark.parametrize("check,value", [
    ("hostname", "h1\n"), ("hostname", "h1\nevil"), ("user", "bob\n"), ("env", "FOO\n"),
    ("job_id", "job1\n"), ("core_job_id", "job1\n"), ("selection", "h1:\u00b2"),
])
def test_a_trailing_newline_or_foreign_digit_does_not_pass_validation(check, value):
    """``$`` in a pattern also matches before a final newline: every rule is fullmatch."""
    from ddl.engines.segments import validate_job_id as core_job_id
    from ddl.errors import DDLConfigError
    from ddlrun.hosts import parse_selection, validate_hostname, validate_user
    from ddlrun.plan import validate_env_name, validate_job_id

    call = {"hostname": validate_hostname, "user": validate_user, "env": validate_env_name,
            "job_id": validate_job_id, "core_job_id": core_job_id,
            "selection": parse_selection}[check]
    with pytest.raises((UsageError, DDLConfigError)):
        call(value)
