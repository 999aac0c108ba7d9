"""The elastic benchmarks' judges (benchmarks/elastic_recovery.py, elastic_false_alarms.py),
checked on made-up stamps and outputs, so that a harness that would call a broken run good
fails here first. Pure: no processes, no namespaces."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


er = load("elastic_recovery")
fa = load("elastic_false_alarms")


def test_a_lost_host_case_loses_the_last_hosts_ranks_and_says_so():
    case = er.Case("numpy", 6, "in-place", hosts=3)
    assert case.world_after() == 4 and case.worlds() == "3x2 -> 2x2"
    assert case.launch() == ["-np", "6", "--min-np", "4", "--max-np", "6"]
    args = case.worker_args("/x")
    assert args[-3:] == ["--kill-rank", "5", "--kill-agent"]
    assert "-H h1:2,h2:2,h3:2 -np 6" in case.shown()
    one_host = er.Case("numpy", 3, "in-place")
    assert one_host.world_after() == 2 and "--kill-agent" not in one_host.worker_args("/x")


def stamps_of(world_after: int, kill: float, firsts: list[float], size: int) -> list[list[dict]]:
    procs = [[{"start": 0.0}, {"t": 1.0, "world": 0, "step": 7, "size": 6}, {"kill": kill}]]
    for t in firsts:
        procs.append([{"start": 0.0}, {"t": t, "world": 1, "step": 7, "size": size},
                      {"t": t + 1, "world": 1, "step": er.STEPS, "size": size}])
    return procs


def test_recovery_is_the_last_survivor_first_step_and_a_wrong_world_is_refused():
    case = er.Case("numpy", 6, "in-place", hosts=3)
    total, _ = er.recovery(case, stamps_of(4, 10.0, [10.1, 10.3, 10.2, 10.05], 4))
    assert total == pytest.approx(0.3)
    with pytest.raises(RuntimeError, match="ranks went on"):  # only one rank lost, not a host
        er.recovery(case, stamps_of(5, 10.0, [10.1] * 5, 5))
    with pytest.raises(RuntimeError, match="ended wrong"):
        er.recovery(case, stamps_of(4, 10.0, [10.1] * 4, 5))


def write_stamps(folder: Path, rows_of: list[list[dict]]) -> None:
    for i, rows in enumerate(rows_of):
        (folder / f"stamps.{i}").write_text("".join(json.dumps(r) + "\n" for r in rows))


def clean_rows(steps: int) -> list[dict]:
    return [{"start": 0.0}] + [{"t": s, "world": 0, "step": s, "size": 4}
                               for s in range(1, steps + 1)]


def test_a_clean_run_is_no_false_alarm(tmp_path):
    write_stamps(tmp_path, [clean_rows(30)] * 4)
    assert fa.judge(0, "ddlrun: world 0 (start): 4 ranks on 2 hosts\n", str(tmp_path), 30) == []


def test_every_sign_of_a_lost_peer_is_a_false_alarm(tmp_path):
    reformed = clean_rows(5) + [{"t": 9.0, "world": 1, "step": 6, "size": 4}]
    write_stamps(tmp_path, [clean_rows(30)] * 3 + [reformed])
    assert fa.judge(0, "", str(tmp_path), 30) == ["re-formed world",
                                                  "steps reached [6, 30, 30, 30]"]
    write_stamps(tmp_path, [clean_rows(30)] * 4)
    out = ("ddlrun: worker h:1 (rank 1 of world 0) failed (ddl.errors.DDLTimeoutError: ...); "
           "re-forming the world\n")
    assert fa.judge(0, out, str(tmp_path), 30) == ["DDLTimeoutError", "re-forming the world"]
    init = "[3]     ddl.init()\n[3] ddl.errors.DDLTimeoutError: rank 3: ...\n"
    assert fa.judge(1, init, str(tmp_path), 30) == ["DDLTimeoutError", "exit 1",
                                                   "in ddl.init()"]
    assert fa.judge(None, "", str(tmp_path), 30) == ["hung"]


class FakeCluster:
    host_ns = ["ns0", "ns1", "ns2"]
    addrs = ["10.0.0.10", "10.0.0.11", "10.0.0.12"]


def test_a_restart_across_hosts_is_one_agent_per_host_that_goes_on_without_the_lost_one():
    for style in ("restart", "torchrun"):
        case = er.Case("numpy", 6, style, hosts=3, last_call=2)
        assert case.per_node() and case.world_after() == 4 and case.worlds() == "3x2 -> 2x2"
        argvs = case.node_argvs("/x", FakeCluster(), 23456)
        assert [a[:4] for a in argvs] == [["ip", "netns", "exec", ns] for ns in FakeCluster.host_ns]
        for argv, addr in zip(argvs, FakeCluster.addrs, strict=True):
            flags = " ".join(argv)
            assert "--nnodes 2:3 --nproc-per-node 2 --max-restarts 1" in flags
            assert "--rdzv-conf last_call_timeout=2" in flags
            assert "--rdzv-endpoint 10.0.0.10:23456" in flags  # every node meets at host 0
            if style == "torchrun":  # the store's host named: every host has one hostname
                assert f"is_host={int(addr == FakeCluster.addrs[0])}" in flags
            assert argv[-5:] == ["--ckpt", "/x", "--kill-rank", "5", "--kill-agent"]
            assert "restart" in argv
            assert ("--local-addr " + addr in flags) == (style == "torchrun")
            assert ("--rdzv-backend c10d" in flags) == (style == "torchrun")
        assert argvs[0][4].endswith("torchrun") == (style == "torchrun")
    assert not er.Case("numpy", 4, "in-place", hosts=2).per_node()
    assert not er.Case("numpy", 3, "restart").per_node()
    assert er.Case("numpy", 3, "restart").world_after() == 3  # one host: all start again


def test_the_nodes_ended_well_only_when_the_lost_host_alone_died_of_sigkill():
    case = er.Case("numpy", 6, "restart", hosts=3)
    assert er.nodes_ended_well(case, [0, -9, 0])
    assert not er.nodes_ended_well(case, [0, 0, 0])  # nothing was lost
    assert not er.nodes_ended_well(case, [0, -9, 1])  # a survivor failed
    assert not er.nodes_ended_well(case, [-9, -9, 0])


def test_the_hosts_table_puts_each_restart_beside_the_in_place_recovery_of_its_world():
    cases = {er.Case("numpy", 4, style, hosts=2): values for style, values in (
        ("in-place", [(0.1, None), (0.2, None), (0.3, None)]),
        ("restart", [(4.0, 1.0), (4.2, 1.2), (3.8, 0.8)]),
        ("torchrun", [(20.0, 15.0), (22.0, 16.0), (21.0, 15.5)]))}
    rows = er.hosts_table(cases)[2:]
    assert rows[0].startswith("| 2x2 -> 1x2 | in-place | 200.0 ms |  |  |")
    assert rows[1].startswith("| 2x2 -> 1x2 | restart | 4.00 s | 20x | 1.00 s |")
    assert rows[2].startswith("| 2x2 -> 1x2 | torchrun | 21.00 s | 105x | 15.50 s |")


def test_a_lost_host_takes_the_agents_other_workers_with_it():
    worker = load("elastic_worker")
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in worker.children(os.getpid())
        assert os.getpid() not in worker.children(child.pid)
    finally:
        child.kill()
        child.wait()


def test_a_run_that_did_not_recover_is_noted_and_measured_again(monkeypatch):
    cases = [er.Case("numpy", 4, style, hosts=2) for style in ("in-place", "torchrun")]
    runs = {"torchrun": iter([RuntimeError("2 ranks went on (expected 1 and 4)"),
                              (16.0, 15.0), (17.0, 16.0)]),
            "in-place": iter([(0.1, None), (0.2, None)])}

    def fake(case, cluster=None):
        got = next(runs[case.style])
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(er, "sample", fake)
    failures: dict = {}
    samples = er.measure(cases, 2, None, failures)
    assert [len(samples[c]) for c in cases] == [2, 2]
    assert failures == {cases[1]: ["2 ranks went on (expected 1 and 4)"]}
    runs["torchrun"] = iter([RuntimeError("boom")])
    with pytest.raises(RuntimeError, match="boom"):  # without a failures dict it stops
        er.measure(cases[1:], 1)


def test_a_case_with_no_run_that_recovered_is_a_row_that_says_so():
    cases = [er.Case("numpy", 4, style, hosts=2) for style in ("in-place", "torchrun")]
    table = er.hosts_table({cases[0]: [], cases[1]: [(16.0, 15.0)]})
    assert table[2] == "| 2x2 -> 1x2 | in-place | no run recovered | | | |"
    assert table[3].startswith("| 2x2 -> 1x2 | torchrun | 16.00 s |  | 15.00 s |")
