"""Test worker for ddlrun: behaviour chosen by argv[1]; argv[2] is a marker the tests use to
find leftover processes. Never busy-loops."""

import json
import os
import signal
import subprocess
import sys
import time

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "DDL_OPTIONS", "DDL_JOB_ID", "DDL_HOST_INDEX",
            "DDL_HOSTS", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
            "FROM_X", "FROM_X_VAL", "DDL_JOB_SECRET", "DDL_JOB_SECRET_FILE")


def secret_in_argv() -> bool:
    """Whether the job secret shows in this rank's or its parent's (ddlrun's, the agent's)
    command line, which every user of the host can read."""
    secret = os.environ.get("DDL_JOB_SECRET", "").encode()
    for pid in ("self", str(os.getppid())):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if secret and secret in f.read():
                return True
    return False


def main() -> int:
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    if mode == "env":
        env = {k: os.environ.get(k) for k in CONTRACT}
        env["secret_in_argv"] = secret_in_argv()
        print(json.dumps(env), flush=True)
        return 0
    if mode == "stopfail":  # stopfail <marker> <stopping rank> <failing rank>
        if rank == int(sys.argv[3]):
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif rank == int(sys.argv[4]):
            time.sleep(1.0)
            print("timed out waiting for a peer", flush=True)
            return 1
        time.sleep(60)
        return 0
    if mode == "fail":  # fail <marker> <rank> <code>
        if rank == int(sys.argv[3]):
            time.sleep(0.5)
            print(f"rank {rank} about to fail", flush=True)
            print("some error detail", file=sys.stderr, flush=True)
            code = int(sys.argv[4])
            if code < 0:
                os.kill(os.getpid(), -code)
            return code
        print("ready", flush=True)
        time.sleep(60)
        return 0
    if mode == "sleep":
        print("ready", flush=True)
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 60)
        return 0
    if mode == "spam":
        for i in range(int(sys.argv[3])):
            print(f"{rank}:{i}:" + "x" * 2000, flush=False)
        return 0
    if mode == "shm":  # shm <marker> <failing rank>: create a segment of the job, fail or sleep
        from ddl import identity
        from ddl.engines import segments

        job, secret = os.environ["DDL_JOB_ID"], identity.job_secret()
        name = segments.segment_name(job, int(os.environ["DDL_HOST_INDEX"]), f"r{rank}", secret)
        segments.create(name, 4096, segments.segment_token(job, secret)).close()
        print("ready", flush=True)
        if rank == int(sys.argv[3]):
            return 3
        time.sleep(60)
        return 0
    if mode == "grandchild":  # leave a child in our session, then fail
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[2]])
        print("ready", flush=True)
        time.sleep(0.5 if rank == 0 else 60)
        return 5 if rank == 0 else 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
