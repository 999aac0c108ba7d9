"""Horovod's ``hvd.SyncBatchNorm``: batch normalization whose statistics cover the batch of
every rank (so a per-rank batch of 2 normalizes like the global batch).

Forward: one allreduce of every channel's count, sum and sum of squares (in float64, so
the variance does not cancel); backward: one allreduce of the sums of ``dy`` and
``dy * x_hat`` that the input gradient needs. The weight and bias gradients stay this
rank's own, as in torch's and Horovod's SyncBatchNorm: the optimizer averages them with
every other gradient. Runs on CPU and GPU tensors (torch's own kernel is GPU-only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

import ddl

from .mpi_ops import allreduce


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (everything but the channel, channel)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t() if x.dim() > 2 else x


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, factor: float,
                process_set: Any) -> torch.Tensor:
        flat = _channels_last(x).to(torch.float64)
        stats = torch.cat([torch.tensor([float(flat.shape[0])], dtype=torch.float64),
                           flat.sum(0), (flat * flat).sum(0)])
        stats = allreduce(stats, op=ddl.Sum, process_set=process_set,
                          name=None)
        count, c = stats[0], x.shape[1]
        if count <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over "
                             f"every rank in training, got {int(count)}")
        mean = stats[1:1 + c] / count
        var = (stats[1 + c:] / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                unbiased = var * count / (count - 1)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype),
                                                  alpha=factor)
        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (x.to(torch.float64) - mean.view(shape)) * invstd.view(shape)
        out = xhat
        if weight is not None:
            out = out * weight.to(torch.float64).view(shape) + bias.to(torch.float64).view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count, ctx.process_set, ctx.has_bias = count, process_set, bias is not None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        c = xhat.shape[1]
        shape = [1, c] + [1] * (xhat.dim() - 2)
        dy64 = dy.to(torch.float64)
        axes = [0] + list(range(2, xhat.dim()))
        local_dy, local_dy_xhat = dy64.sum(axes), (dy64 * xhat).sum(axes)
        sums = allreduce(torch.cat([local_dy, local_dy_xhat]), op=ddl.Sum,
                         process_set=ctx.process_set, name=None)
        sum_dy, sum_dy_xhat = sums[:c], sums[c:]
        scale = invstd if weight is None else invstd * weight.to(torch.float64)
        dx = (dy64 - (sum_dy / ctx.count).view(shape)
              - xhat * (sum_dy_xhat / ctx.count).view(shape)) * scale.view(shape)
        dweight = local_dy_xhat.to(weight.dtype) if weight is not None else None
        dbias = local_dy.to(weight.dtype) if ctx.has_bias else None
        return dx.to(dy.dtype), dweight, dbias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``hvd.SyncBatchNorm(num_features, eps, momentum, affine,
    track_running_stats)``, for inputs of 2 to 5 dimensions (N, C, ...). In eval mode (or
    without running statistics in training on one rank) it is a plain batch norm.
    ``process_set`` limits the statistics to a Horovod process set."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as torch's
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return torch.nn.functional.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False,
                0.0, self.eps)
        running = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(
            input, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, factor, self.process_set)
