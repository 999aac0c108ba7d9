"""Horovod's capability flags describe this build, so scripts that branch on them choose
the right path."""

import importlib.util

import ddl.torch as hvd


def test_flags_describe_the_build_and_the_running_engine():
    hvd.init()
    try:
        assert hvd.gloo_built()
        assert hvd.mpi_built() == (importlib.util.find_spec("mpi4py") is not None)
        # one process: no cross-host transport is running
        assert not hvd.mpi_enabled() and not hvd.gloo_enabled()
        assert hvd.ddl_built() and hvd.nccl_built() == 0
    finally:
        hvd.shutdown()
