"""Run a worker under plain mpirun as if every two ranks were a host: the ranks learn
their "host" from Open MPI's rank, then the worker runs unchanged."""

import os
import runpy
import sys

per = int(os.environ.get("SIM_PER_HOST", "2"))
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
os.environ.update(LOCAL_RANK=str(rank % per), LOCAL_WORLD_SIZE=str(per),
                  DDL_HOST_INDEX=str(rank // per), GROUP_RANK=str(rank // per))
if os.environ.get("SIM_NO_MASTER_ADDR") == str(rank):  # this rank cannot find rank 0's
    os.environ.pop("MASTER_ADDR", None)
os.environ.pop("OMPI_COMM_WORLD_LOCAL_RANK", None)
os.environ.pop("OMPI_COMM_WORLD_LOCAL_SIZE", None)
if sys.argv[1] == "-m":  # a module, as python -m runs it
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
