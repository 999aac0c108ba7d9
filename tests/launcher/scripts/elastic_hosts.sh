#!/bin/sh
# A discovery script for the elastic tests: elastic_hosts.sh FOLDER prints FOLDER/N on its
# N-th run (from 0), and the highest N there is from then on; FOLDER/runs counts the runs.
dir=$1
n=$(cat "$dir/runs" 2>/dev/null || echo 0)
echo $((n + 1)) > "$dir/runs"
while [ "$n" -gt 0 ] && [ ! -e "$dir/$n" ]; do
    n=$((n - 1))
done
cat "$dir/$n"
