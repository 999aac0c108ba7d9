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
