"""ddlrun command line: ``args.build_parser()`` -> ``configure.config_from_args()`` (typed,
validated, no side effects, no file read: the hostfile, rankfile and the program's ``#!``
line come read by ``steps.read_files``) -> ``main()``: the steps of ``ddlrun.steps``,
``preflight()`` (probe the hosts), ``check_program()`` (a missing script or module, before
any rank), ``job_inputs()`` (draw the job id, port and secret), ``plan_job()`` (pure),
``act()`` (print for --dry-run, or supervise), with one output sink.

Side effects live in the steps, not in the planner: the job id, the free port (a note when
it is a guess: ``steps.choose_port``), the job's secret (``steps.job_secret_env``) and the
sweep of orphaned shared memory at start.

``build_parser``, ``parse_args``, ``config_from_args`` and ``MAX_RESTARTS`` are reached
through this module too (the console script is ``ddlrun.cli:main``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from . import check_build, diagnose
from .args import build_parser, parse_args
from .backends import Backend, get_backend
from .config import Config
from .configure import MAX_RESTARTS, config_from_args, files_named
from .elastic_run import run_elastic
from .errors import LaunchError, PreflightError, UsageError
from .node_elastic import run_node_elastic
from .output import OutputSink, silence
from .plan import JobPlan
from .reaper import become_subreaper
from .run import Interrupted, signals_raise
from .steps import (
    act,
    check_ddl_env,
    check_program,
    check_staging,
    job_inputs,
    plan_job,
    preflight,
    read_files,
    restart_inputs,
    run_cleanup,
)

# main, and what tests reach through ``ddlrun.cli`` (the parser's and configure's names)
__all__ = ["MAX_RESTARTS", "build_parser", "config_from_args", "main", "parse_args",
           "warn_unset"]


def main(argv: Sequence[str] | None = None) -> int:
    """``ddlrun [options] program [args...]``: its exit code (the job's, or why none ran)."""
    become_subreaper()  # before any fork: the ranks' orphans come to us (reaper.py)
    parser = build_parser()
    try:
        try:
            args = parse_args(argv, parser)
        except UsageError as exc:  # a peer launcher's flag that ddlrun spells otherwise
            OutputSink().note(f"error: {exc}")
            return exc.exit_code
        sink = OutputSink(tag=args.tag_output, ranks=args.output_ranks)  # the run's one sink
        return _main(parser, args, sink)
    except BrokenPipeError:  # ddlrun --dry-run ... | head -1
        silence(sys.stdout)
        return 141  # 128 + SIGPIPE, what a shell shows for a writer whose reader left


def warn_unset(cfg: Config, environ: Mapping[str, str], sink: OutputSink) -> None:
    """A note for each ``-x KEY`` that this shell does not set (it is not exported)."""
    for key, value in cfg.request.env:
        if value is None and key not in environ:
            sink.note(f"warning: -x {key}: {key} is not set here, so it is not exported "
                      f"(set it, or give -x {key}=VALUE)")


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, sink: OutputSink) -> int:
    """The modes that run no job (--check-build, --cleanup), then preflight, plan, act."""
    try:
        if args.check_build:
            if args.program:
                raise UsageError("--check-build runs no program: ddlrun --check-build "
                                 "[--json] [--require NAME]")
            return check_build.run(args.json, args.require, sink.note)
        if args.json or args.require:
            raise UsageError("--json and --require go with --check-build")
        if args.diagnose is not None:
            if args.program:
                raise UsageError("--diagnose runs no program: ddlrun --diagnose [JOB]")
            return diagnose.diagnose_job(args.diagnose or None, sink.note, cwd=os.getcwd())
        cfg = config_from_args(args, os.environ, read_files(*files_named(args, os.environ)))
        if cfg.cleanup:
            return run_cleanup(cfg.job_id, sink)
        if not cfg.request.program and not cfg.check:
            parser.print_usage(sys.stderr)
            raise UsageError("no program given: ddlrun [options] program [args...]")
        warn_unset(cfg, os.environ, sink)
        check_ddl_env(cfg, os.environ)
        backend = get_backend(cfg.launcher, cfg.options)
        with signals_raise():  # Ctrl-C while hosts are probed: no traceback, no ssh left
            facts = preflight(cfg, backend, sink, os.environ)
        if cfg.check:
            return 0
        if not cfg.dry_run:
            check_program(cfg, os.environ)
        inputs = job_inputs(cfg, facts, os.environ)
        for note in inputs.notes:
            sink.note(note)
        plan = plan_job(cfg, facts, inputs, os.environ)
        check_staging(cfg, plan, os.environ)
        backend.validate(plan)
        if cfg.elastic is not None and not cfg.dry_run:
            return run_elastic(cfg, facts, inputs, sink, os.environ)
        if cfg.rendezvous is not None and not cfg.dry_run:
            return run_node_elastic(cfg, facts, inputs, sink, os.environ)

        def next_attempt(attempt: int) -> tuple[JobPlan, Backend]:  # --max-restarts
            again = plan_job(cfg, facts, restart_inputs(cfg, inputs, attempt, os.environ),
                             os.environ)
            fresh = get_backend(cfg.launcher, cfg.options)
            fresh.validate(again)
            return again, fresh

        return act(cfg, plan, backend, sink, next_attempt)
    except PreflightError as exc:
        if exc.table and not (args.check or args.verbose):
            print(exc.table, file=sys.stderr)
        for problem in exc.problems:
            sink.note(f"preflight: {problem}")
        return exc.exit_code
    except LaunchError as exc:
        sink.note(f"error: {exc}")
        return exc.exit_code
    except Interrupted as exc:
        sink.note(f"{exc}: stopped during the preflight; no rank was started")
        return 128 + exc.signum
