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

``make_plan`` puts the named parts together: the data types (``plan_types``, re-exported
here), where the ranks go (``placement``), DDL_OPTIONS (``plan_options``), every rank's env
(``plan_env``); ``plan_render`` prints a plan.
"""

from __future__ import annotations

from collections.abc import Mapping

from . import envs
from .core import validate_job_id
from .errors import UsageError
from .hosts import HostSpec
from .placement import assign, layout_of, parse_rankfile, unknown_slots, whole_job
from .plan_env import common_env, gpus_per_host, rank_specs, user_env_of, validate_env_name
from .plan_options import ddl_options, default_mode, grid
from .plan_render import describe, masked, rankfile_lines
from .plan_types import (
    Attempt,
    HostFacts,
    HostGpus,
    HostPlan,
    JobPlan,
    RankSpec,
    Request,
    attempt_job_id,
)

# the plan's types and the parts tests and ddl.perf.spawn reach through ``ddlrun.plan``
__all__ = [
    "Attempt", "HostFacts", "HostGpus", "HostPlan", "HostSpec", "JobPlan", "RankSpec", "Request",
    "assign", "attempt_job_id", "ddl_options", "default_mode", "describe", "grid",
    "make_plan", "masked", "parse_rankfile", "rankfile_lines", "validate_env_name",
]


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
    user_env = user_env_of(req, environ)
    gpus_of = gpus_per_host(req, facts, environ, user_env)
    layout = layout_of(req, assign(req, facts, gpus_of))
    hosts = [req.hosts[i] for i in layout.used]
    omp_set = dict(user_env)  # OMP_NUM_THREADS the user set stays theirs
    if envs.OMP_NUM_THREADS in environ:
        omp_set[envs.OMP_NUM_THREADS] = environ[envs.OMP_NUM_THREADS]
    options = ddl_options(req, whole_job(layout),
                          user_env.get(envs.DDL_OPTIONS, environ.get(envs.DDL_OPTIONS)))
    common = common_env(req, facts, layout, hosts, job_id, master_port, options, user_env,
                        secret_env or {}, export_job_id, attempt)
    per_host = rank_specs(req, facts, layout, hosts, common, omp_set, gpus_of)
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
