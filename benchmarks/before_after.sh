#!/bin/bash
# Before and after side by side, one script: an older tree (git archive of REV into a
# folder) against this checkout, alternating, ROUNDS times. Run on a quiet machine.
#   bash benchmarks/before_after.sh REV [ROUNDS]
set -u
rev=${1:?usage: before_after.sh REV [ROUNDS]}
rounds=${2:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
old=$(mktemp -d)
trap 'rm -rf "$old"' EXIT
git -C "$here" archive "$rev" | tar -x -C "$old"
py="$here/.venv/bin/python"
for round in $(seq "$rounds"); do
  for tree in "$old" "$here"; do
    name=$([ "$tree" = "$here" ] && echo after || echo "before ($rev)")
    export PYTHONPATH="$tree/ddl-core:$tree/launcher"
    for s in 1K 1M 64M; do
      echo "### round $round, $name: allreduce $s"
      timeout 300 "$py" -m ddl.perf.cli allreduce --ranks 2 -b "$s" -e "$s" \
        --compare ddl,ddl-heap -n 40 2>&1 | grep -E "^ +[0-9]|wrong|Out of bounds"
    done
    echo "### round $round, $name: cpu per call"
    timeout 300 "$py" "$here/benchmarks/cpu_per_call.py" 2>&1 | tail -1
    echo "### round $round, $name: folded identity"
    timeout 300 "$py" "$tree/benchmarks/identity_fold/micro_fold.py" 2>&1 | tail -1
  done
done
