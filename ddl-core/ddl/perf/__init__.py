"""ddl-perf: bandwidth and latency of collectives, side by side with the peers."""
