"""Described clusters for ``ddl-perf simulate --preset``, from published hardware figures.

Every number below is a published specification or a figure stated in the paper cited
next to it, except where a comment says "assumption"; none was adjusted to make a
published efficiency come out (the simulator prints its prediction next to the paper's).

Sources:
- PowerAI DDL: M. Cho, U. Finkler, S. Kumar, D. Kung, V. Saxena, D. Sreedhar, "PowerAI DDL",
  arXiv:1708.02188 (2017): ResNet-50 on 64 IBM S822LC hosts x 4 NVIDIA P100 (256 GPUs),
  Mellanox InfiniBand EDR (100 Gbit/s), batch 32 per GPU, 95% scaling efficiency at 256 GPUs
  (Caffe; the multi-ring allreduce across a 4 x 16 x 4 grid).
- P. Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
  arXiv:1706.02677 (2017): ResNet-50 on 32 servers x 8 P100 (Big Basin, NVLink inside a
  server), 50 Gbit/s Ethernet between servers, 32 images per GPU (8k minibatch); ~90%
  (the paper reports 89%) scaling efficiency from 8 to 256 GPUs, measured against one 8-GPU server.
  Their allreduce: sum within a server, recursive halving-doubling across servers on the
  whole buffer, broadcast back; overlapped with backprop.
- NVIDIA P100 SXM2 datasheet: 10.6 TFLOP/s fp32, 732 GB/s HBM2, NVLink 1: 4 links x 20 GB/s
  per direction per GPU. NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3,
  NVLink 4 900 GB/s (450 GB/s per direction). NDR InfiniBand: 400 Gbit/s per port, one
  ConnectX-7 per GPU in DGX/HGX H100 systems.
- ResNet-50 (He et al. 2015, arXiv:1512.03385): 3.8-4.1 G multiply-adds per 224x224 image
  forward (we take 4.1 G = 8.2 GFLOP), x3 for forward + backward; 25.557 M parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .. import cost

RESNET50_PARAMS = 25_557_032
RESNET50_TRAIN_FLOPS = 3 * 8.2e9  # per image: forward 4.1 G MACs, backward twice that


@dataclass(frozen=True)
class Published:
    efficiency: float
    gpus: int
    baseline_gpus: int  # efficiency = throughput_N / (N / baseline x throughput_baseline)
    source: str


@dataclass(frozen=True)
class Cluster:
    """What the simulator needs to know about a cluster and a model."""
    name: str
    gpus_per_host: int
    hosts_per_rack: int
    racks: int
    links: tuple[cost.Link, cost.Link, cost.Link]  # in a host, between hosts, between racks
    algorithms: tuple[str, str, str]  # per dimension; 'best' = the cost model's pick (mode b)
    peak_flops: float  # per GPU, the precision trained in
    utilization: float  # achieved fraction of peak (assumption, stated per preset)
    params: int
    bytes_per_grad: int
    train_flops_per_sample: float
    batch_per_gpu: int
    overlap: float  # fraction of backward that communication can hide behind
    global_batch_cap: int = 0  # strong scaling: the largest global batch that converges
    chunk_bytes: int = 8 << 20
    hierarchy: str = "ddl"  # 'ddl': multi-dimensional; 'reduce-bcast': Goyal's scheme
    published: Published | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def max_gpus(self) -> int:
        return self.gpus_per_host * self.hosts_per_rack * self.racks

    @property
    def grad_bytes(self) -> int:
        return self.params * self.bytes_per_grad

    def with_(self, **changes) -> Cluster:
        return replace(self, **changes)


def _link(alpha: float, bytes_per_s: float, hbm: float) -> cost.Link:
    # gamma: a GPU reduction reads two buffers and writes one at HBM speed
    return cost.Link(alpha=alpha, beta=1 / bytes_per_s, gamma=3 / hbm)


P100_HBM = 732e9
H100_HBM = 3.35e12
# alpha per message step: NVLink ~2 us, InfiniBand/RoCE ~5 us, TCP Ethernet ~20 us.
# Assumptions (typical small-message latencies with software overhead), not fitted.
PRESETS: dict[str, Cluster] = {
    "powerai-2017": Cluster(
        name="PowerAI DDL 2017: 64 hosts x 4 P100, InfiniBand EDR, ResNet-50",
        gpus_per_host=4, hosts_per_rack=16, racks=4,
        links=(_link(2e-6, 40e9, P100_HBM),  # P100 NVLink 1: 2 links per GPU pair
               _link(5e-6, 12.5e9, P100_HBM),  # EDR 100 Gbit/s per host
               _link(5e-6, 12.5e9, P100_HBM)),
        algorithms=("ring", "best", "best"),
        peak_flops=10.6e12, utilization=0.5,  # assumption: ~215 img/s per P100, fp32
        params=RESNET50_PARAMS, bytes_per_grad=4,
        train_flops_per_sample=RESNET50_TRAIN_FLOPS, batch_per_gpu=32, overlap=0.0,
        global_batch_cap=8192,
        published=Published(0.95, 256, 1, "Cho et al., PowerAI DDL, arXiv:1708.02188"),
        notes=("Caffe's DDL integration allreduced after backward: overlap 0 (assumption)",)),
    "goyal-2017": Cluster(
        name="Goyal et al. 2017: 32 servers x 8 P100, 50 Gbit/s Ethernet, ResNet-50",
        gpus_per_host=8, hosts_per_rack=32, racks=1,
        links=(_link(2e-6, 20e9, P100_HBM),  # NVLink 1 hybrid cube mesh: ~1 link per ring hop
               _link(20e-6, 6.25e9, P100_HBM),  # 50 Gbit/s Ethernet per server
               _link(20e-6, 6.25e9, P100_HBM)),
        algorithms=("ring", "hd", "hd"),
        peak_flops=10.6e12, utilization=0.5,  # assumption, as above
        params=RESNET50_PARAMS, bytes_per_grad=4,
        train_flops_per_sample=RESNET50_TRAIN_FLOPS, batch_per_gpu=32, overlap=1.0,
        global_batch_cap=8192, hierarchy="reduce-bcast",
        published=Published(0.89, 256, 8, "Goyal et al., arXiv:1706.02677"),
        notes=("allreduce overlapped with backprop (the paper): overlap 1.0",
               "efficiency measured against one 8-GPU server, as in the paper")),
    "h100-ndr": Cluster(
        name="8x H100 SXM hosts, NVLink 4 + NDR 400 Gbit/s per GPU, ResNet-50 bf16",
        gpus_per_host=8, hosts_per_rack=32, racks=40,
        links=(_link(2e-6, 450e9, H100_HBM),  # NVLink 4, per direction
               _link(5e-6, 50e9, H100_HBM),  # one 400 Gbit/s NIC per GPU: per grid line
               _link(5e-6, 50e9, H100_HBM)),
        algorithms=("ring", "best", "best"),
        peak_flops=989e12, utilization=0.075,  # assumption: ~3,000 img/s per H100 (CNNs
        # reach far below the bf16 peak; the order of MLPerf ResNet-50 submissions)
        params=RESNET50_PARAMS, bytes_per_grad=2,
        train_flops_per_sample=RESNET50_TRAIN_FLOPS, batch_per_gpu=256, overlap=0.8,
        global_batch_cap=65536,
        notes=("no published efficiency: a what-if for a current cluster",)),
}
