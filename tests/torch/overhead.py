"""Compare the per-call cost of ``hvd.allreduce`` of two ddl.torch implementations side by
side on 2 local ranks (not a test: run by hand).

    python tests/torch/overhead.py --before DIR [--rounds 3] [--reps 400]

DIR holds a ``ddl`` package (e.g. a copy of ddl-core/ddl with an older ddl/torch); rounds
alternate between it and this checkout. The table gives, in microseconds, the median over
rounds of each round's median, and of hvd.allreduce minus the core's ddl.allreduce (no
identity exchange) timed in the same job: the per-call overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from torch_util import reports, run_worker  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="directory holding the older ddl package")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=400)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for label in ("before", "after"):
            env = {"PYTHONPATH": os.path.abspath(args.before)} if label == "before" else {}
            rep = reports(run_worker("overhead.py", 2, str(args.reps), env=env, timeout=600))
            runs[label].append(rep[0])
    # The core's ddl.allreduce runs interleaved with hvd.allreduce in the same job, so
    # hvd - core is the per-call overhead under the same conditions (memory bandwidth on a
    # shared machine moves both by several ms at 64 MiB).
    print("# hvd.allreduce(op=Sum), 2 ranks, us per call: median over rounds of each "
          "round's median")
    print(f"# {'bytes':>9} {'before':>9} {'after':>9} {'core':>9} {'before-core':>12} "
          f"{'after-core':>11}")
    table = {}
    for size in runs["after"][0]:
        row = {label: statistics.median(r[size]["hvd_us"] for r in runs[label])
               for label in runs}
        over = {label: statistics.median(r[size]["hvd_us"] - r[size]["core_us"]
                                         for r in runs[label]) for label in runs}
        core = statistics.median(r[size]["core_us"] for lab in runs for r in runs[lab])
        table[size] = {**row, "core": core, "overhead_before": over["before"],
                       "overhead_after": over["after"]}
        print(f"  {size:>9} {row['before']:9.1f} {row['after']:9.1f} {core:9.1f} "
              f"{over['before']:12.1f} {over['after']:11.1f}")
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
