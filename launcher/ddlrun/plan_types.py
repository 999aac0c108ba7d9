"""The plan's data: frozen dataclasses for what preflight learned (``HostFacts``), what the
command line asks (``Request``), a host's GPUs (``HostGpus``), which start of the job this
is (``Attempt``) and the plan itself (``JobPlan`` of ``HostPlan`` of ``RankSpec``). Below
every step that builds or reads a plan (``placement``, ``plan_env``, ``plan_options``,
``plan_render``, ``plan.make_plan``), so each of them and the backends share one
definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .hosts import HostSpec


@dataclass(frozen=True)
class HostFacts:
    """What preflight learned about a host (defaults: nothing known)."""

    cores: int = 1
    gpus: int = 0
    address: str | None = None  # the host's address on --network-interface
    hostname: str = ""
    versions: tuple[tuple[str, str], ...] = ()
    free_port: int | None = None


@dataclass(frozen=True)
class Request:
    """Everything planning needs from the command line (built by configure.config_from_args)."""

    program: tuple[str, ...]
    hosts: tuple[HostSpec, ...] = ()
    nproc: int | None = None
    accelerators: int | None = None
    mode: str | None = None
    racks: int | None = None
    aisles: int | None = None
    ddloptions: tuple[str, ...] = ()
    no_ddloptions: bool = False
    env: tuple[tuple[str, str | None], ...] = ()  # -x KEY[=VAL]
    network_interface: str | None = None
    master_addr: str | None = None
    tcp: bool = False
    rankfile: tuple[tuple[int, str], ...] = ()  # (rank, host) from a user rankfile
    bind_gpus: bool = False  # --bind-gpus: each rank sees only its GPU
    include: tuple[tuple[str, tuple[str, ...] | None], ...] = ()  # --include host[:ids]
    exclude: tuple[tuple[str, tuple[str, ...] | None], ...] = ()  # --exclude host[:ids]
    nnodes: int | None = None  # torchrun-style: one ddlrun per node (with node_rank)
    node_rank: int | None = None


@dataclass(frozen=True)
class HostGpus:
    """The GPUs a host's ranks use and what CUDA_VISIBLE_DEVICES gets: ``leave`` (as the
    user has it), ``set`` (the host's list, from --include/--exclude) or ``bind`` (the
    rank's one GPU, ids[local_rank % len(ids)])."""

    ids: tuple[str, ...] = ()
    mode: str = "leave"
    selected: bool = False  # the list comes from --include/--exclude (it counts as slots)

    def visible(self, local_rank: int) -> str | None:
        if self.mode == "set":
            return ",".join(self.ids)
        if self.mode == "bind" and self.ids:
            return self.ids[local_rank % len(self.ids)]
        return None

    def encode(self) -> str:
        """For ``ddlrun.rankenv`` (DDLRUN_HOST_GPUS, hosts joined by ';')."""
        return f"{self.mode}:{','.join(self.ids)}"

    @classmethod
    def decode(cls, text: str) -> HostGpus:
        mode, _, ids = text.partition(":")
        return cls(tuple(i for i in ids.split(",") if i), mode or "leave")


@dataclass(frozen=True)
class Attempt:
    """Which start of the job this plan is (``--max-restarts``, torchrun's restarts):
    ``number`` 0 first, then 1, 2, ... after each failure, up to ``max_restarts``; ``run_id``
    the id every attempt shares (the first attempt's job id), the ranks'
    TORCHELASTIC_RUN_ID, while each attempt has a job id of its own."""

    number: int = 0
    max_restarts: int = 0
    run_id: str | None = None


def attempt_job_id(run_id: str, number: int) -> str:
    """The job id of attempt ``number``: the run's own first, then ``RUN.r1``, ``RUN.r2``,
    ...: new shared-memory names and a new rendezvous each time, logs side by side."""
    return run_id if number == 0 else f"{run_id}.r{number}"


@dataclass(frozen=True)
class RankSpec:
    rank: int
    local_rank: int
    host_index: int
    host: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class HostPlan:
    index: int
    host: HostSpec
    ranks: tuple[RankSpec, ...]
    gpus: HostGpus = field(default_factory=HostGpus)


@dataclass(frozen=True)
class JobPlan:
    job_id: str
    world_size: int
    master_addr: str
    master_port: int
    ddl_options: str | None
    hosts: tuple[HostPlan, ...]
    program: tuple[str, ...]
    common_env: tuple[tuple[str, str], ...] = field(default=())
    unknown_slots: tuple[str, ...] = ()  # hosts whose ranks were guessed (1): not probed

    @property
    def ranks(self) -> tuple[RankSpec, ...]:
        return tuple(r for h in self.hosts for r in h.ranks)

    @property
    def host_names(self) -> tuple[str, ...]:
        return tuple(h.host.name for h in self.hosts)

    @property
    def layout(self) -> tuple[int, ...]:
        """Host index of every rank, in rank order."""
        return tuple(r.host_index for r in sorted(self.ranks, key=lambda r: r.rank))
