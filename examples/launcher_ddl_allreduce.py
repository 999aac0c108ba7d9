"""Allreduce with the ddl library under ddlrun:

    ddlrun -n 2 python examples/launcher_ddl_allreduce.py


Every rank contributes ``rank + 1``; the sum over ranks must be ``n (n + 1) / 2``.
"""

import numpy as np

import ddl


def main() -> int:
    ddl.init()
    try:
        rank, size = ddl.rank(), ddl.size()
        x = np.full(1024, rank + 1, dtype=np.float32)
        y = ddl.allreduce(x, op=ddl.Sum)
        want = size * (size + 1) / 2
        if not np.allclose(y, want):
            print(f"rank {rank}: wrong result {y[:4]}, want {want}", flush=True)
            return 1
        print(f"rank {rank}/{size} local {ddl.local_rank()}: allreduce ok", flush=True)
        return 0
    finally:
        ddl.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
