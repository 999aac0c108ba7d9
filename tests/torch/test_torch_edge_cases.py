"""On 2 real ranks (workers/hvd_edge_cases.py): float16 and bfloat16 prescale/postscale
(Average, and gradient_predivide_factor's pair) bit for bit as Horovod's ScaleBuffer, for
torch tensors and the numpy arrays of ddl.tensorflow; alltoall of tensors whose rows have no
elements, with and without splits; and the "ddl" backend's AVG and all_gather of inference
tensors finished on its worker thread."""

from torch_util import reports, run_worker


def test_scaling_alltoall_and_inference_tensors_on_2_ranks():
    for r in reports(run_worker("hvd_edge_cases.py", 2)):
        assert r["failed"] == [], r
