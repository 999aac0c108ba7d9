"""The job plan: who runs where, with which argv and env. Pure: no I/O, no clock, no
randomness (the job id, master port and job secret come in as inputs), so tests assert on
it directly.

Env contract, for every rank (torchrun-compatible, so unchanged torch scripts run): the
variables of ``ddlrun.envs`` (the registry: each one's meaning is written there once), kinds
``rank`` (RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT,
DDL_OPTIONS DDL_JOB_ID DDL_JOB_SECRET DDL_HOST_INDEX DDL_HOSTS) and ``torchrun`` (what
torchrun sets, so ``torch.distributed.is_torchelastic_launched()`` is True), plus the
``option`` ones where their option asks (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, the socket
interfaces, NCCL_IB_DISABLE). The secret's value is never printed (``masked``).
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from . import core, envs
from .core import validate_job_id
from .errors import UsageError
from .hosts import HostSpec, is_local

MASK = "<secret>"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
    """Everything planning needs from the command line (built by cli.config_from_args)."""

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


# ---------------------------------------------------------------------------- placement
def split_ids(text: str) -> tuple[str, ...]:
    """``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) as a tuple of ids."""
    return tuple(i.strip() for i in text.split(",") if i.strip())


def _selection(entries, host: HostSpec) -> tuple[bool, tuple[str, ...] | None]:
    """(host named, its GPU ids or None for the whole host) in --include/--exclude."""
    for name, ids in entries:
        if name == host.name or (is_local(name) and is_local(host.name)):
            return True, ids
    return False, None


def host_gpus(req: Request, host: HostSpec, facts: HostFacts | None,
              user_visible: str | None) -> HostGpus:
    """The GPUs ranks on ``host`` use. The set: the user's CUDA_VISIBLE_DEVICES on a host
    with GPUs, else the GPUs detected (0..n-1), else (for --include/--exclude only) the
    host's slots 0..N-1. --include host:ids replaces it, --exclude host:ids removes from it;
    either makes CUDA_VISIBLE_DEVICES that list. --bind-gpus gives each rank one."""
    gpus = facts.gpus if facts else 0
    if gpus and user_visible is not None:
        ids = split_ids(user_visible)
    else:
        ids = tuple(str(i) for i in range(gpus))
    mode = "leave"
    named, chosen = _selection(req.include, host)
    if named and chosen is not None:
        ids, mode = chosen, "set"
    named, dropped = _selection(req.exclude, host)
    if named and dropped is not None:
        if not ids and host.slots:
            ids = tuple(str(i) for i in range(host.slots))
        if not ids:
            raise UsageError(f"--exclude {host.name}:{','.join(dropped)}: the GPUs of "
                             f"{host.name} are unknown (not probed, no slots): give "
                             f"{host.name}:N or use --include")
        ids, mode = tuple(i for i in ids if i not in dropped), "set"
        if not ids:
            raise UsageError(f"--exclude leaves no GPUs on {host.name}")
    selected = mode == "set"
    if req.bind_gpus and ids:
        mode = "bind"
    return HostGpus(ids, mode, selected)


def slots_per_host(req: Request, facts: Mapping[str, HostFacts],
                   gpus: Sequence[HostGpus] | None = None) -> list[int]:
    """Ranks each host can take: --accelerators, else its --include/--exclude GPU list,
    else the host's slots, else its GPUs (CUDA_VISIBLE_DEVICES counts), else -n for a
    single host, else 1."""
    if gpus is None:
        gpus = [host_gpus(req, h, facts.get(h.name), None) for h in req.hosts]
    out = []
    for h, g in zip(req.hosts, gpus, strict=True):
        if req.accelerators is not None:
            out.append(req.accelerators)
        elif g.selected:
            out.append(len(g.ids))
        elif h.slots is not None:
            out.append(h.slots)
        elif g.ids:  # the GPUs detected, or those of the user's CUDA_VISIBLE_DEVICES
            out.append(len(g.ids))
        elif len(req.hosts) == 1 and req.nproc:
            out.append(req.nproc)
        else:
            out.append(1)
    return out


def unknown_slots(req: Request, facts: Mapping[str, HostFacts]) -> tuple[str, ...]:
    """Hosts whose rank count is a guess: no slots, no --accelerators, not probed."""
    if req.accelerators is not None or req.rankfile or (len(req.hosts) == 1 and req.nproc):
        return ()
    return tuple(h.name for h in req.hosts
                 if h.slots is None and h.name not in facts
                 and _selection(req.include, h)[1] is None)


def assign(req: Request, facts: Mapping[str, HostFacts],
           gpus: Sequence[HostGpus] | None = None) -> list[tuple[int, int]]:
    """(host index, local rank) for every rank, in rank order. Fills host by host."""
    if not req.hosts:
        raise UsageError("no hosts: give -n N for local ranks, or -H / --hostfile")
    if req.rankfile:
        return _assign_rankfile(req)
    slots = slots_per_host(req, facts, gpus)
    total = sum(slots)
    n = req.nproc if req.nproc is not None else total
    if n < 1:
        raise UsageError(f"-n must be at least 1, got {n}")
    if n > total:
        listing = ", ".join(f"{h.name}:{s}" for h, s in zip(req.hosts, slots, strict=True))
        raise UsageError(
            f"asked for {n} ranks but the hosts provide only {total} slots ({listing}): "
            "add hosts, raise slots (host:N / slots=N / --accelerators) or lower -n"
        )
    out: list[tuple[int, int]] = []
    for index, count in enumerate(slots):
        for local in range(count):
            if len(out) == n:
                return out
            out.append((index, local))
    return out


def _assign_rankfile(req: Request) -> list[tuple[int, int]]:
    names = [h.name for h in req.hosts]
    by_rank = dict(req.rankfile)
    if sorted(by_rank) != list(range(len(by_rank))):
        raise UsageError("rankfile: ranks must be 0..N-1 with none missing")
    if req.nproc is not None and req.nproc != len(by_rank):
        raise UsageError(f"rankfile has {len(by_rank)} ranks but -n is {req.nproc}")
    counts: dict[str, int] = {}
    out = []
    for rank in range(len(by_rank)):
        host = by_rank[rank]
        if host not in names:
            raise UsageError(f"rankfile: rank {rank} is on {host!r}, which is not in the hosts")
        out.append((names.index(host), counts.get(host, 0)))
        counts[host] = counts.get(host, 0) + 1
    return out


def parse_rankfile(lines: Sequence[str], source: str = "rankfile") -> tuple[tuple[int, str], ...]:
    """Open MPI rankfile lines ``rank N=host slot=...`` -> ((rank, host), ...)."""
    from .hosts import validate_hostname

    out = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"rank\s+([0-9]+)\s*=\s*(\S+)(?:\s+slot=\S+)?", line)
        if not m:
            raise UsageError(f"{source}:{lineno}: expected 'rank N=host slot=S', got {line!r}")
        out.append((int(m.group(1)), validate_hostname(m.group(2), f"{source}:{lineno}")))
    if not out:
        raise UsageError(f"{source}: no ranks found")
    return tuple(out)


# ---------------------------------------------------------------------------- options
def grid(ranks_per_host: int, nhosts: int, racks: int | None, aisles: int | None) -> list[int]:
    """Machine grid, innermost first: GPUs per host x hosts per rack x racks per aisle x
    aisles. Dimensions of size 1 are dropped (a grid of one dimension is a flat ring)."""
    dims = [ranks_per_host]
    racks = racks or 1
    aisles = aisles or 1
    if nhosts % racks:
        raise UsageError(f"--racks {racks} does not divide the {nhosts} hosts evenly")
    if racks % aisles:
        raise UsageError(f"--aisles {aisles} does not divide the {racks} racks evenly")
    dims += [nhosts // racks, racks // aisles, aisles]
    kept = [d for d in dims if d > 1]
    return kept or [1]


def inherited_options(text: str | None, drop_mode: bool) -> list[str]:
    """DDL_OPTIONS from ddlrun's own environment, as options given before the command
    line's --ddloption; its ``-mode`` yields to --mode (``drop_mode``)."""
    words = (text or "").split()
    if drop_mode and "-mode" in words:
        at = words.index("-mode")
        del words[at:at + 2]
    return [" ".join(words)] if words else []


def ddl_options(req: Request, placement: Sequence[tuple[int, int]],
                inherited: str | None = None) -> str | None:
    """What every rank's DDL_OPTIONS says: ``-mode`` with the job's grid, then the options
    of ``inherited`` (DDL_OPTIONS in ddlrun's environment) and --ddloption, in that order;
    None with --no_ddloptions."""
    if req.no_ddloptions:
        return None
    extra = [*inherited_options(inherited, drop_mode=bool(req.mode)), *req.ddloptions]
    if not req.mode and any("-mode" in o.split() for o in extra):
        return " ".join(extra)  # --ddloption "-mode b:2x2" is the user's mode
    world = len(placement)
    per_host: dict[int, int] = {}
    for host, _ in placement:
        per_host[host] = per_host.get(host, 0) + 1
    mode = req.mode or default_mode()
    letters, _, dims = mode.partition(":")
    if dims:
        spec = mode
    else:
        counts = set(per_host.values())
        if len(counts) == 1:
            spec = f"{letters}:" + "x".join(
                str(d) for d in grid(counts.pop(), len(per_host), req.racks, req.aisles)
            )
        else:  # uneven hosts: no grid describes them, use one flat dimension
            spec = f"{letters}:{world}"
    _check_mode(spec, mode, world if dims else None)
    return " ".join(("-mode", spec, *extra))


def default_mode() -> str:
    """The mode letters when ``--mode`` gives none: the core's own default
    (``ddl.options.DEFAULT_MODE``, the one source), so a job under ddlrun and one started
    by hand run the same algorithm."""
    options = core.require(core.options(), "its default mode",
                           "give the letters with --mode (r, n, b, p), or reinstall powerddl")
    return options.DEFAULT_MODE


def _check_mode(spec: str, given: str, world: int | None) -> None:
    """``spec`` by ddl's own ``-mode`` grammar and, with ``world``, its grid against the
    job's rank count (``ddl.options.parse_mode`` and ``grid_mismatch``, the one copy of
    each). Where ``import ddl`` fails the launcher cannot check it: the workers' ddl does,
    when it reads DDL_OPTIONS."""
    options, errors = core.options(), core.errors()
    if options is None or errors is None:  # left to the ranks
        return
    try:
        letters, shape = options.parse_mode(spec)
    except errors.DDLConfigError as e:
        raise UsageError(f"--mode {given!r} is invalid: {e}") from None
    why = options.grid_mismatch(letters, shape, world) if world is not None and shape else None
    if why:
        raise UsageError(f"--mode {given!r}: {why}")


# ---------------------------------------------------------------------------- env
def validate_env_name(name: str) -> str:
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


def _user_env(req: Request, environ: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in req.env:
        validate_env_name(key)
        if value is None:
            if key in environ:
                out[key] = environ[key]
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class _Layout:
    """Where the ranks go: ``placement`` (host index in ``req.hosts``, local rank) in rank
    order; ``used`` the hosts that got ranks (the others drop out of the plan); with one
    ddlrun per node, ranks are offset by this node's share."""

    placement: tuple[tuple[int, int], ...]
    used: tuple[int, ...]
    local_size: tuple[int, ...]  # per used host
    offset: int
    world: int
    nnodes: int
    per_node: bool


def _layout(req: Request, placement: Sequence[tuple[int, int]]) -> _Layout:
    counts = Counter(h for h, _ in placement)
    used = tuple(sorted(counts))
    local_size = tuple(counts[h] for h in used)
    per_node = req.node_rank is not None
    nnodes = req.nnodes or 1
    return _Layout(
        placement=tuple(placement),
        used=used,
        local_size=local_size,
        offset=req.node_rank * len(placement) if per_node else 0,
        world=len(placement) * nnodes if per_node else len(placement),
        nnodes=nnodes,
        per_node=per_node,
    )


def _whole_job(layout: _Layout) -> list[tuple[int, int]]:
    """Every rank of the job (all nodes when one ddlrun runs per node): what the grid of
    DDL_OPTIONS describes."""
    if not layout.per_node:
        return list(layout.placement)
    return [(n, local) for n in range(layout.nnodes) for _, local in layout.placement]


def _gpus_per_host(req: Request, facts: Mapping[str, HostFacts],
                   environ: Mapping[str, str], user_env: Mapping[str, str]) -> list[HostGpus]:
    """The GPUs of every host; ranks on this host inherit ddlrun's CUDA_VISIBLE_DEVICES
    unless ``-x`` gives one."""
    theirs = user_env.get(envs.CUDA_VISIBLE_DEVICES)
    return [host_gpus(req, h, facts.get(h.name),
                      theirs if theirs is not None or not is_local(h.name)
                      else environ.get(envs.CUDA_VISIBLE_DEVICES))
            for h in req.hosts]


def _common_env(req: Request, facts: Mapping[str, HostFacts], layout: _Layout,
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


def _rank_specs(req: Request, facts: Mapping[str, HostFacts], layout: _Layout,
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


def _check_inputs(req: Request, job_id: str, master_port: int) -> None:
    if not req.program:
        raise UsageError("no program given: ddlrun [options] program [args...]")
    validate_job_id(job_id)
    if not 0 < master_port < 65536:
        raise UsageError(f"--master-port {master_port} is out of range 1-65535")


def make_plan(
    req: Request,
    facts: Mapping[str, HostFacts],
    job_id: str,
    master_port: int,
    environ: Mapping[str, str],
    secret_env: Mapping[str, str] | None = None,
    export_job_id: bool = True,
    attempt: Attempt = Attempt(),  # noqa: B008 - frozen
) -> JobPlan:
    """Build the whole job plan. ``environ`` is the launcher's env (for ``-x KEY``);
    ``secret_env`` the variables that carry the job's secret to every rank (the caller draws
    a new secret or passes the user's on: drawing one is a side effect). Without
    ``export_job_id`` (one ddlrun per node, no --rdzv-id) DDL_JOB_ID is left unset so ddl
    agrees one at init; ``job_id`` then only names this launcher's logs. ``attempt``: which
    start of the job this is (``--max-restarts``)."""
    _check_inputs(req, job_id, master_port)
    user_env = _user_env(req, environ)
    gpus_of = _gpus_per_host(req, facts, environ, user_env)
    layout = _layout(req, assign(req, facts, gpus_of))
    hosts = [req.hosts[i] for i in layout.used]
    omp_set = dict(user_env)  # OMP_NUM_THREADS the user set stays theirs
    if envs.OMP_NUM_THREADS in environ:
        omp_set[envs.OMP_NUM_THREADS] = environ[envs.OMP_NUM_THREADS]
    options = ddl_options(req, _whole_job(layout),
                          user_env.get(envs.DDL_OPTIONS, environ.get(envs.DDL_OPTIONS)))
    common = _common_env(req, facts, layout, hosts, job_id, master_port, options, user_env,
                         secret_env or {}, export_job_id, attempt)
    per_host = _rank_specs(req, facts, layout, hosts, common, omp_set, gpus_of)
    names = {h.name for h in hosts}
    return JobPlan(
        job_id=job_id,
        world_size=layout.world,
        master_addr=common[envs.MASTER_ADDR],
        master_port=master_port,
        ddl_options=options,
        hosts=tuple(HostPlan(i, h, tuple(per_host[i]), gpus_of[layout.used[i]])
                    for i, h in enumerate(hosts)),
        program=req.program,
        common_env=tuple(sorted(common.items())),
        unknown_slots=tuple(n for n in unknown_slots(req, facts) if n in names),
    )


def rankfile_lines(plan: JobPlan, cores: Mapping[str, int] | None = None) -> list[str]:
    """Open MPI rankfile for the plan: ``rank R=host slot=S`` (S = local rank modulo the
    host's cores, so oversubscribed hosts stay valid)."""
    lines = []
    for r in sorted(plan.ranks, key=lambda r: r.rank):
        ncores = (cores or {}).get(r.host) or 0
        slot = r.local_rank % ncores if ncores else r.local_rank
        lines.append(f"rank {r.rank}={r.host} slot={slot}")
    return lines


def quote(value: str) -> str:
    """``shlex.quote``, but a value with control characters (a newline could forge a line
    of the printout) is written in bash's ``$'...'`` form with escapes."""
    if value.isprintable():
        return shlex.quote(value)
    out = []
    for ch in value:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        else:
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
    return "$'" + "".join(out) + "'"


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def masked(key: str, value: str) -> str:
    """``KEY=VALUE`` for printing, the value quoted: secrets shown as ``<secret>``."""
    return f"{key}={MASK if envs.is_secret(key) else quote(value)}"


def describe(plan: JobPlan, cwd: str | None = None) -> str:
    """Human-readable plan for --dry-run and -v (values quoted, secrets masked): every
    rank's argv, working directory and env."""
    out = [
        f"job {plan.job_id}: {plan.world_size} ranks on {len(plan.hosts)} host(s)",
        f"  MASTER_ADDR={quote(plan.master_addr)} MASTER_PORT={plan.master_port}",
        f"  DDL_OPTIONS={quote(plan.ddl_options)}" if plan.ddl_options is not None
        else "  DDL_OPTIONS not set (--no_ddloptions)",
    ]
    for name in plan.unknown_slots:
        out.append(f"  note: slots of {name} are unknown (no {name}:N, its GPUs not probed in "
                   "--dry-run): planned 1 rank there; the real run takes one rank per GPU "
                   f"nvidia-smi lists there, else 1 (give {name}:N or --accelerators N)")
    common = dict(plan.common_env)
    for h in plan.hosts:
        local = is_local(h.host.name)
        out.append(f"host {h.index} {h.host.destination}: ranks "
                   + ",".join(str(r.rank) for r in h.ranks))
        for r in h.ranks:
            own = {k: v for k, v in r.env if common.get(k) != v}
            out.append(f"  [{r.rank}] argv: " + " ".join(quote(a) for a in r.argv))
            if cwd:
                where = "" if local else " (if it exists there, else the login directory)"
                out.append(f"  [{r.rank}] cwd: {quote(cwd)}{where}")
            base = "ddlrun's environment" if local else "the remote login environment"
            out.append(f"  [{r.rank}] env: {base} + common env + "
                       + " ".join(masked(k, v) for k, v in sorted(own.items())))
    out.append("common env: " + " ".join(masked(k, v) for k, v in plan.common_env))
    return "\n".join(out)
