"""Worker of tests/launcher/test_restarts.py: it decides from TORCHELASTIC_RESTART_COUNT
what this start of the job does. argv: MODE MARKER OUTDIR [ARGS]; MARKER lets the tests
find leftover processes; each start of each rank writes OUTDIR/a<attempt>.r<rank>.json
with the torchrun variables it saw (and the job's id, port and secret, to show that every
attempt is a new job).

    once OUTDIR VICTIM     attempt 0: rank VICTIM raises ValueError after ddl.init();
                           every attempt: the others wait in an allreduce (Sum) of
                           RANK + 1, whose result every rank prints as JSON
    always OUTDIR VICTIM CODE    every attempt: rank VICTIM exits CODE after ddl.init()
                           (the others wait in an allreduce, and fail with it)
    hang OUTDIR VICTIM     attempt 0 as ``once``; later attempts: print "ready", sleep
    stubborn OUTDIR VICTIM attempt 0: the other ranks ignore SIGTERM and print "stubborn",
                           rank VICTIM exits 5 once they have (a teardown that waits for
                           --grace); later attempts: as ``once``
    late OUTDIR VICTIM CODE  every attempt: after 0.5 s rank VICTIM exits CODE (no ddl)
"""

import json
import os
import signal
import sys
import time

TORCHRUN = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
            "DDL_JOB_ID", "MASTER_PORT", "DDL_JOB_SECRET", "RANK")


def record(outdir: str, attempt: int, rank: int) -> None:
    with open(os.path.join(outdir, f"a{attempt}.r{rank}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in TORCHRUN}, f)


def allreduce_and_print(attempt: int) -> None:
    import numpy as np

    import ddl

    total = ddl.allreduce(np.full(4, float(ddl.rank() + 1), np.float32), op=ddl.Sum)
    print(json.dumps({"rank": ddl.rank(), "attempt": attempt, "sum": total.tolist()}),
          flush=True)


def main() -> int:
    mode, outdir, victim = sys.argv[1], sys.argv[3], int(sys.argv[4])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    record(outdir, attempt, rank)
    if mode == "late":
        time.sleep(0.5)
        return int(sys.argv[5]) if rank == victim else 0
    import ddl

    ddl.init()
    if mode == "always" and rank == victim:
        return int(sys.argv[5])
    if mode == "stubborn" and attempt == 0:
        if rank == victim:  # fail once every peer ignores the teardown's SIGTERM
            while len([n for n in os.listdir(outdir) if n.startswith("stubborn")]) < \
                    ddl.size() - 1:
                time.sleep(0.05)
            return 5
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(outdir, f"stubborn.{rank}"), "w").close()
        print("stubborn", flush=True)
        time.sleep(120)
        return 0
    if mode in ("once", "hang") and attempt == 0 and rank == victim:
        raise ValueError(f"boom on rank {rank}")
    if mode == "hang" and attempt > 0:
        print("ready", flush=True)
        time.sleep(120)
        return 0
    allreduce_and_print(attempt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
