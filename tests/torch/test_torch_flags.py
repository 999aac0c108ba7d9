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
        assert hvd.ddl_built()
        # Horovod's value: NCCL's version code when built with it (PyPI's CUDA build of
        # torch carries NCCL), 0 without (a CPU build)
        import torch

        if torch.version.cuda and torch.distributed.is_nccl_available():
            major, minor, patch = torch.cuda.nccl.version()
            assert hvd.nccl_built() == major * 10000 + minor * 100 + patch
        else:
            assert hvd.nccl_built() == 0
    finally:
        hvd.shutdown()
