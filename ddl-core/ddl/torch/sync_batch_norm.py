"""Horovod's ``hvd.SyncBatchNorm``: batch normalization whose statistics cover the batch of
every rank (so a per-rank batch of 2 normalizes like the global batch).

Forward: each rank's count, mean and variance per channel (``torch.var_mean``, in the
input's dtype), one allgather of them in float64, and the job's statistics combined from
them as torch's SyncBatchNorm does (means weighted by counts, each rank's squared
deviations plus its mean's distance to the job's: no sum of squares whose difference
cancels); the output is torch's own batch-norm kernel with those statistics. Backward: the
per-channel sums of ``dy`` and ``dy * x_hat`` from torch's batch-norm backward kernel, one
allreduce of them, and the input gradient in three passes over the tensor. The weight and
bias gradients stay this rank's own, as in torch's and Horovod's SyncBatchNorm: the
optimizer averages them with every other gradient. Runs on CPU and GPU tensors (torch's own
kernel is GPU-only). No full-size float64 copy is made: the first version computed in
float64 throughout and made the upstream Horovod ResNet benchmark 2.5x slower per step
than plain BatchNorm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

import ddl

from .mpi_ops import allgather, allreduce


def _axes(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _param_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype torch's batch-norm kernel takes its statistics in: the weight's (float32
    beside a half or bfloat16 input), else float32 or float64 as the input."""
    if weight is not None:
        return weight.dtype
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, factor: float,
                process_set: Any) -> torch.Tensor:
        c = x.shape[1]
        n = x.numel() // c if c else 0
        if n:
            # half and bfloat16 statistics would round the mean itself: float32, as torch's
            # batch norm accumulates them
            wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
            var_l, mean_l = torch.var_mean(wide, dim=_axes(x), correction=0)
            mine = torch.cat([torch.tensor([float(n)], dtype=torch.float64, device=x.device),
                              mean_l.to(torch.float64), var_l.to(torch.float64) * n])
        else:  # an empty batch here: it adds nothing
            mine = torch.zeros(2 * c + 1, dtype=torch.float64, device=x.device)
        rows = allgather(mine.view(1, -1), process_set=process_set, name=None)
        counts, means, m2s = rows[:, 0], rows[:, 1:1 + c], rows[:, 1 + c:]
        count = counts.sum()
        if count <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over "
                             f"every rank in training, got {int(count)}")
        mean = (counts[:, None] * means).sum(0) / count
        var = (m2s + counts[:, None] * (means - mean) ** 2).sum(0) / count
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                unbiased = var * count / (count - 1)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype),
                                                  alpha=factor)
        pd = _param_dtype(x, weight)
        out = torch.nn.functional.batch_norm(x, mean.to(pd), var.to(pd), weight, bias,
                                             training=False, momentum=0.0, eps=eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.process_set, ctx.has_bias, ctx.eps = count, process_set, \
            bias is not None, eps
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        shape = [1, c] + [1] * (x.dim() - 2)
        pd = _param_dtype(x, weight)
        dy = dy.contiguous()
        # sum(dy * x_hat) and sum(dy) per channel, this rank's, in torch's fused kernel
        _, local_dy_xhat, local_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, None, None, mean.to(pd), invstd.to(pd), train=True, eps=ctx.eps,
            output_mask=[False, True, True])
        sums = allreduce(torch.cat([local_dy, local_dy_xhat]).to(torch.float64), op=ddl.Sum,
                         process_set=ctx.process_set, name=None)
        sum_dy, sum_dy_xhat = sums[:c], sums[c:]
        k = invstd if weight is None else invstd * weight.to(torch.float64)
        # dx = k * (dy - sum_dy / N - x_hat * sum_dy_xhat / N), x_hat = (x - mean) * invstd
        slope = (-k * invstd * sum_dy_xhat / ctx.count).to(x.dtype).view(shape)
        shift = (-k * sum_dy / ctx.count).to(x.dtype).view(shape)
        dx = x - mean.to(x.dtype).view(shape)
        dx.mul_(slope).add_(shift).addcmul_(dy, k.to(x.dtype).view(shape))
        dweight = local_dy_xhat.to(weight.dtype) if weight is not None else None
        dbias = local_dy.to(weight.dtype) if ctx.has_bias else None
        return dx, dweight, dbias, None, None, None, None, None


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
                input, self.running_mean, self.running_var, self.weight, self.bias,
                training=False, momentum=0.0, eps=self.eps)
        running = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(
            input, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, factor, self.process_set)
