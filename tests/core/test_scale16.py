"""Horovod's ScaleBuffer on 16-bit floats (prescale_factor, postscale_factor, and so
gradient_predivide_factor): each element converted to float32, multiplied by the factor as
a float32, rounded back once (horovod/common/ops/collective_operations.h,
ScaleBufferCPUImpl's float16 specialisation). numpy alone rounds the factor to 16 bits
first, which is one unit in the last place off for a few percent of the elements. Checked
here on every finite float16 and bfloat16 value, for numpy arrays (what ddl.tensorflow hands
the core) and torch tensors."""

from __future__ import annotations

import numpy as np
import pytest

from ddl.hvd.arrays import NumpyOps

# every finite value includes the largest: times 2.5 they overflow to inf, as in Horovod
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")

FACTORS = [0.3, 1.0 / 3.0, 0.7, 1.9, 2.5, 1e-3, 1.0 / 7.0]


def every_finite(dtype) -> np.ndarray:
    """Every finite, non-NaN value of a 16-bit float type, from its bit patterns."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    return x[np.isfinite(x.astype(np.float32))]


def horovod(x: np.ndarray, factor: float) -> np.ndarray:
    return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)


def dtypes_16() -> list:
    out = [np.dtype(np.float16)]
    ml_dtypes = pytest.importorskip("ml_dtypes")
    out.append(np.dtype(ml_dtypes.bfloat16))
    return out


@pytest.mark.parametrize("factor", FACTORS)
def test_numpy_16_bit_scaling_is_horovods_float32_formula(factor):
    for dt in dtypes_16():
        x = every_finite(dt)
        want = horovod(x, factor)
        got = NumpyOps.scaled(x, factor)
        assert got.dtype == dt
        bad = got.view(np.uint16) != want.view(np.uint16)
        assert not bad.any(), (dt, factor, int(bad.sum()), x[bad][:5], got[bad][:5])
        y = x.copy()
        NumpyOps.scale_(y, factor)
        assert np.array_equal(y.view(np.uint16), want.view(np.uint16)), (dt, factor)


def test_the_check_can_tell_a_16_bit_factor_from_a_float32_one():
    """What the old code did (the factor rounded to float16) differs on these inputs: the
    test above would have caught it."""
    x = every_finite(np.dtype(np.float16))
    rounded = (x.astype(np.float32) * np.float32(np.float16(0.3))).astype(np.float16)
    assert (rounded.view(np.uint16) != horovod(x, 0.3).view(np.uint16)).mean() > 0.01


def test_numpy_other_dtypes_scale_as_before():
    x32 = np.linspace(-5, 5, 1001, dtype=np.float32)
    assert np.array_equal(NumpyOps.scaled(x32, 0.3), x32 * np.float32(0.3))
    x64 = np.linspace(-5, 5, 1001)
    assert np.array_equal(NumpyOps.scaled(x64, 0.3), x64 * 0.3)
    i = np.arange(-50, 50, dtype=np.int32)
    assert np.array_equal(NumpyOps.scaled(i, 0.7), (i * 0.7).astype(np.int32))  # truncated


@pytest.mark.parametrize("factor", FACTORS)
def test_torch_16_bit_scaling_is_horovods_float32_formula(factor):
    torch = pytest.importorskip("torch")
    from ddl.hvd.arrays import TorchOps

    for dt, np_dt in ((torch.float16, np.float16), (torch.bfloat16, None)):
        bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
        x = bits.view(dt)
        x = x[torch.isfinite(x.float())]
        want = (x.float() * torch.tensor(factor, dtype=torch.float32)).to(dt)
        got = TorchOps.scaled(x, factor)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (dt, factor)
        y = x.clone()
        TorchOps.scale_(y, factor)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), (dt, factor)
        if np_dt is not None:  # the same bits as the numpy path
            assert np.array_equal(got.numpy(), NumpyOps.scaled(x.numpy(), factor))


def test_torch_scale_of_an_inference_tensor():
    """In place on an inference tensor, outside inference mode (the thread that finishes
    a collective is not the caller's)."""
    torch = pytest.importorskip("torch")
    from ddl.hvd.arrays import TorchOps

    with torch.inference_mode():
        t = torch.arange(6, dtype=torch.float16)
        i = torch.arange(6, dtype=torch.int64)
    TorchOps.scale_(t, 0.5)
    TorchOps.scale_(i, 0.5)
    TorchOps.copy_(t, t + 1)
    assert t.tolist() == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert i.tolist() == [0, 0, 1, 1, 2, 2]
