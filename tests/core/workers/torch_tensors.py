"""torch CPU tensors through the core API: every dtype torch has, views, in place."""

import json

import torch

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
ok = {}
tri = N * (N + 1) // 2
for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool):
    for count in (0, 1, 33, 70_001):
        x = torch.full((count,), R + 1, dtype=dt) if dt != torch.bool else torch.full(
            (count,), R % 2 == 0, dtype=dt)
        got = ddl.allreduce(x, op=ddl.Sum)
        want = torch.full((count,), tri, dtype=dt) if dt != torch.bool else torch.full(
            (count,), True, dtype=dt)
        ok[f"{dt}-{count}"] = bool(type(got) is torch.Tensor and got.dtype == dt
                                   and torch.equal(got, want))
        if dt.is_floating_point:
            y = x.clone()
            ddl.allreduce_(y, op=ddl.Average)
            ok[f"{dt}-{count}-avg"] = bool(torch.equal(y, torch.full((count,), tri / N, dtype=dt)))
# bfloat16 rounding: accumulate in float32, round once like torch's own sum of float32
v = torch.tensor([1.0 + 2**-7, 3.0, -2.5], dtype=torch.bfloat16) * (R + 1)
got = ddl.allreduce(v, op=ddl.Sum)
ref = sum((v / (R + 1) * (i + 1)).float() for i in range(N)).to(torch.bfloat16)
ok["bf16-round"] = bool(torch.equal(got, ref))
# a view (non-contiguous) reduced in place writes back into its base
base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (R + 1)
view = base[:, 1::2]
ddl.allreduce_(view, op=ddl.Sum)
ok["view"] = bool(torch.equal(base[:, 1::2], torch.arange(24.).reshape(4, 6)[:, 1::2] * tri))
ok["view-rest"] = bool(torch.equal(base[:, ::2], torch.arange(24.).reshape(4, 6)[:, ::2] * (R + 1)))
p = torch.nn.Parameter(torch.ones(5) * R)
got = ddl.allreduce(p, op=ddl.Max)
ok["param"] = bool(torch.equal(got, torch.full((5,), float(N - 1))))
g = ddl.allgather(torch.full((R + 1, 2), R, dtype=torch.bfloat16))
ok["gather-bf16"] = g.dtype == torch.bfloat16 and g.shape == (tri, 2)
b = ddl.broadcast(torch.full((3,), float(R)), root_rank=N - 1)
ok["bcast"] = bool(torch.equal(b, torch.full((3,), float(N - 1))))
rs = ddl.reduce_scatter(torch.ones(2 * N + 1, 3), op=ddl.Sum)
ok["rs"] = rs.shape[0] == ddl.split_rows(2 * N + 1, N)[R] and bool((rs == N).all())
print(json.dumps({"rank": R, "failed": [k for k, v in ok.items() if not v]}))
ddl.shutdown()
