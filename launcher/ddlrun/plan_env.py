"""The env of every rank in a plan: the job-wide part all ranks share (``common_env``: the
user's ``-x``, the secret, WORLD_SIZE, MASTER_ADDR/PORT, DDL_OPTIONS, torchrun's and
horovodrun's job variables) and each rank's own (``rank_env``: RANK, LOCAL_RANK, the cross
rank, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS). The contract itself is written in
``ddlrun.plan``'s docstring and each variable's meaning in ``ddlrun.envs``. Pure.

Not ``ddlrun.rankenv``: that is the program mpirun and srun start on each host, which
computes ``rank_env`` there from the launcher's variables; this module builds the env of
every rank ddlrun plans itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from . import envs
from .errors import UsageError
from .hosts import HostSpec, is_local
from .placement import Layout, host_gpus
from .plan_types import Attempt, HostFacts, HostGpus, RankSpec, Request

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def validate_env_name(name: str) -> str:
    """``name`` if it can be an environment variable's (``-x``), else a UsageError."""
    if not _ENV_NAME.fullmatch(name):
        raise UsageError(f"-x {name!r}: not a valid environment variable name")
    return name


def rank_env(
    rank: int,
    local_rank: int,
    local_size: int,
    host_index: int,
    facts: HostFacts,
    user_env: Mapping[str, str],
    gpus: HostGpus | None = None,
    cross: tuple[int, int] | None = None,
) -> dict[str, str]:
    """The per-rank part of the env contract (shared with ``ddlrun.rankenv`` for mpirun and
    srun, where it is computed on the rank's host). ``cross``: Horovod's cross rank and size
    (``cross_of``), when the layout of every host is known."""
    env = {
        envs.RANK: str(rank),
        envs.LOCAL_RANK: str(local_rank),
        envs.LOCAL_WORLD_SIZE: str(local_size),
        envs.GROUP_RANK: str(host_index),
        envs.DDL_HOST_INDEX: str(host_index),
        envs.ROLE_RANK: str(rank),
        envs.HOROVOD_RANK: str(rank),
        envs.HOROVOD_LOCAL_RANK: str(local_rank),
        envs.HOROVOD_LOCAL_SIZE: str(local_size),
    }
    if cross is not None:
        env[envs.HOROVOD_CROSS_RANK], env[envs.HOROVOD_CROSS_SIZE] = map(str, cross)
    dev = gpus.visible(local_rank) if gpus else None
    if dev is not None:
        env[envs.CUDA_VISIBLE_DEVICES] = dev
    if envs.OMP_NUM_THREADS not in user_env:
        env[envs.OMP_NUM_THREADS] = str(max(1, facts.cores // max(1, local_size)))
    return env


def cross_of(local_sizes: Sequence[int], host_index: int, local_rank: int) -> tuple[int, int]:
    """Horovod's cross rank and size: this rank's place among the ranks of the same local
    rank, one per host that has that many ranks (hosts in host-index order)."""
    having = [h for h, n in enumerate(local_sizes) if n > local_rank]
    return having.index(host_index), len(having)


def _master_addr(req: Request, host0: HostSpec, facts: Mapping[str, HostFacts]) -> str:
    if req.master_addr:
        return req.master_addr
    f = facts.get(host0.name)
    if f and f.address:
        return f.address
    if all(is_local(h.name) for h in req.hosts):
        return "127.0.0.1"
    return host0.name.strip("[]")


def user_env_of(req: Request, environ: Mapping[str, str]) -> dict[str, str]:
    """``-x KEY[=VAL]``: the value given, else this shell's (unset here: not exported)."""
    out: dict[str, str] = {}
    for key, value in req.env:
        validate_env_name(key)
        if value is None:
            if key in environ:
                out[key] = environ[key]
        else:
            out[key] = value
    return out


def gpus_per_host(req: Request, facts: Mapping[str, HostFacts],
                   environ: Mapping[str, str], user_env: Mapping[str, str]) -> list[HostGpus]:
    """The GPUs of every host; ranks on this host inherit ddlrun's CUDA_VISIBLE_DEVICES
    unless ``-x`` gives one."""
    theirs = user_env.get(envs.CUDA_VISIBLE_DEVICES)
    return [host_gpus(req, h, facts.get(h.name),
                      theirs if theirs is not None or not is_local(h.name)
                      else environ.get(envs.CUDA_VISIBLE_DEVICES))
            for h in req.hosts]


def common_env(req: Request, facts: Mapping[str, HostFacts], layout: Layout,
                hosts: Sequence[HostSpec], job_id: str, master_port: int,
                options: str | None, user_env: Mapping[str, str],
                secret_env: Mapping[str, str], export_job_id: bool,
                attempt: Attempt) -> dict[str, str]:
    """The env every rank shares: the user's ``-x``, the secret, the contract's job-wide
    variables and those of --network-interface / --tcp."""
    common = dict(user_env)
    common.update(secret_env)
    common.update({
        envs.WORLD_SIZE: str(layout.world),
        envs.MASTER_ADDR: _master_addr(req, hosts[0], facts),
        envs.MASTER_PORT: str(master_port),
        envs.TORCHELASTIC_RUN_ID: (attempt.run_id or job_id) if export_job_id else "none",
        envs.TORCHELASTIC_RESTART_COUNT: str(attempt.number),
        envs.TORCHELASTIC_MAX_RESTARTS: str(attempt.max_restarts),
        envs.GROUP_WORLD_SIZE: str(layout.nnodes if layout.per_node else len(hosts)),
        envs.ROLE_WORLD_SIZE: str(layout.world),
        envs.ROLE_NAME: "default",
        envs.HOROVOD_SIZE: str(layout.world),
    })
    if export_job_id:
        common[envs.DDL_JOB_ID] = job_id
    if not layout.per_node:  # one ddlrun per node knows only its own host
        common[envs.DDL_HOSTS] = ",".join(h.name for h in hosts)
    if options is not None:
        common[envs.DDL_OPTIONS] = options
    if req.network_interface:
        common[envs.GLOO_SOCKET_IFNAME] = req.network_interface
        common[envs.NCCL_SOCKET_IFNAME] = req.network_interface
    if req.tcp:
        common[envs.NCCL_IB_DISABLE] = "1"
    return common


def rank_specs(req: Request, facts: Mapping[str, HostFacts], layout: Layout,
                hosts: Sequence[HostSpec], common: Mapping[str, str],
                omp_set: Mapping[str, str], gpus_of: Sequence[HostGpus]
                ) -> dict[int, list[RankSpec]]:
    """Every rank's argv and whole env, by (new) host index."""
    per_host: dict[int, list[RankSpec]] = {i: [] for i in range(len(hosts))}
    new_index = {old: new for new, old in enumerate(layout.used)}  # rankless hosts drop out
    for rank, (old, local) in enumerate(layout.placement):
        index = new_index[old]
        host = hosts[index]
        node = req.node_rank if layout.per_node else index
        env = dict(common)
        # one ddlrun per node knows its own host only: the nodes are alike (--nproc-per-node)
        sizes = ([layout.local_size[index]] * layout.nnodes if layout.per_node
                 else layout.local_size)
        env.update(rank_env(layout.offset + rank, local, layout.local_size[index], node,
                            facts.get(host.name, HostFacts()), omp_set, gpus_of[old],
                            cross_of(sizes, node, local)))
        per_host[index].append(RankSpec(layout.offset + rank, local, index, host.name,
                                        req.program, tuple(sorted(env.items()))))
    return per_host
