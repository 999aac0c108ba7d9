"""The core and the Horovod-level layer import, and run a collective, with torch and
tensorflow made unimportable: what both framework adapters share needs neither."""

from __future__ import annotations

import subprocess
import sys

CODE = r"""
import sys


class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "tensorflow", "keras", "jax"):
            raise ImportError(f"{name} is blocked by the test")
        return None


sys.meta_path.insert(0, Block())
import numpy as np
import ddl
import ddl.hvd.arrays, ddl.hvd.collectives, ddl.hvd.compression, ddl.hvd.fusion
import ddl.hvd.join, ddl.hvd.lifecycle, ddl.hvd.negotiate, ddl.hvd.settings
import ddl.hvd.control, ddl.hvd.descriptor, ddl.hvd.fold, ddl.hvd.named
from ddl.hvd import collectives as C, lifecycle

lifecycle.init()
x = np.arange(5, dtype=np.float32)
assert np.array_equal(C.allreduce(x, op=ddl.Sum), x)
assert C.allgather(np.float64(2.0) * np.ones(())).shape == (1,)
assert C.broadcast(np.asarray(3.5), 0).shape == ()
assert C.broadcast_object({"a": 1}, 0) == {"a": 1}
half, ctx = ddl.hvd.compression.FP16Compressor.compress(x)
assert half.dtype == np.float16 and ddl.hvd.compression.FP16Compressor.decompress(
    half, ctx).dtype == np.float32
lifecycle.shutdown()
assert not any(m.split(".")[0] in ("torch", "tensorflow", "keras") for m in sys.modules)
print("ok")
"""


def test_core_and_hvd_layer_need_no_framework():
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "1",
                                         "RANK": "0", "LOCAL_RANK": "0"})
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr
