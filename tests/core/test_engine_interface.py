"""The engine interface (engines/base.py, issue 25): every engine implements ``Engine``
structurally, the ones that fold call identities ``IdentityFold``, the network groups
``PeerGroup`` and their contexts ``PeerContext``, the device engine ``TensorEngine``; and
no code of the core asks an engine what it has with ``getattr``/``hasattr``."""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
import typing
from pathlib import Path

import numpy as np
import pytest

from ddl.dtypes import BY_NAME
from ddl.engines.base import (
    Engine,
    IdentityFold,
    PeerContext,
    PeerGroup,
    TensorEngine,
    identity_fold,
)
from ddl.engines.device import DeviceEngine
from ddl.engines.gloo import GlooContext, GlooGroup
from ddl.engines.local import LocalEngine
from ddl.engines.mpi import MPIContext, MPIGroup
from ddl.engines.multihost import DimsEngine, MultiHostEngine
from ddl.engines.shm import ShmEngine
from ddl.ops import ReduceOp

CORE = Path(__file__).resolve().parents[2] / "ddl-core" / "ddl"


# ------------------------------------------------------------ conformance by class
def _members(protocol: type) -> tuple[dict[str, inspect.Signature], set[str]]:
    """(methods with their signatures, data attributes) a Protocol declares."""
    methods = {name: inspect.signature(getattr(protocol, name))
               for name, value in vars(protocol).items()
               if callable(value) and not name.startswith("_")}
    data = set(typing.get_type_hints(protocol)) if protocol.__annotations__ else set()
    return methods, data - set(methods)


def _assigned(cls: type) -> set[str]:
    """Names a class or its bases bind: class attributes, and ``self.x = ...`` (or
    annotated) in any method, ``__init__``'s included."""
    names = set()
    for klass in cls.__mro__[:-1]:
        names |= set(vars(klass))
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign)
                       else [])
            for target in targets:
                for leaf in ast.walk(target):
                    if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self"):
                        names.add(leaf.attr)
    return names


def _parameters(sig: inspect.Signature) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in sig.parameters.values() if p.name != "self"]


def missing(cls: type, protocol: type) -> list[str]:
    """What ``cls`` lacks to implement ``protocol``: a member, or a method whose
    parameters (names, kinds, order) differ; parameters the class adds must have defaults."""
    methods, data = _members(protocol)
    have = _assigned(cls)
    wrong = [f"attribute {name}" for name in sorted(data) if name not in have]
    for name, want in methods.items():
        impl = getattr(cls, name, None)
        if impl is None or not callable(impl):
            wrong.append(f"method {name}")
            continue
        got = inspect.signature(impl)
        params = _parameters(got)
        expected = _parameters(want)
        extra = [p for p in list(got.parameters.values())[len(expected) + 1:]
                 if p.default is inspect.Parameter.empty and p.kind not in
                 (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        if params[: len(expected)] != expected or extra:
            wrong.append(f"{name}{got} is not {name}{want}")
    return wrong


@pytest.mark.parametrize("cls", [LocalEngine, ShmEngine, DimsEngine, MultiHostEngine])
def test_every_host_engine_is_an_engine(cls):
    assert missing(cls, Engine) == []


@pytest.mark.parametrize("cls", [ShmEngine, DimsEngine, MultiHostEngine])
def test_shared_memory_and_multihost_engines_fold_identities(cls):
    assert missing(cls, IdentityFold) == []


@pytest.mark.parametrize("cls", [GlooGroup, MPIGroup])
def test_the_transports_are_peer_groups(cls):
    assert missing(cls, PeerGroup) == []


@pytest.mark.parametrize("cls", [GlooContext, MPIContext])
def test_the_transports_contexts_make_peer_groups(cls):
    assert missing(cls, PeerContext) == []


def test_the_device_engine_is_a_tensor_engine():
    assert missing(DeviceEngine, TensorEngine) == []


def test_a_class_that_falls_short_is_found():
    class NoRefuse(LocalEngine):
        refuse = None  # type: ignore[assignment]

    class Reordered(LocalEngine):
        def broadcast(self, buf, root: int, dt, shape) -> None:  # type: ignore[override]
            pass

    class Needy(LocalEngine):
        def barrier(self, timeout: float) -> None:  # type: ignore[override]
            pass

    class Nameless:
        def barrier(self) -> None:
            pass

    assert missing(NoRefuse, Engine) == ["method refuse"]
    assert [w.split("(")[0] for w in missing(Reordered, Engine)] == ["broadcast"]
    assert [w.split("(")[0] for w in missing(Needy, Engine)] == ["barrier"]
    assert "attribute name" in missing(Nameless, Engine)
    assert missing(LocalEngine, IdentityFold) == ["attribute armed", "method fold_identity",
                                                  "method cancel_fold",
                                                  "method exchange_identity"]


# --------------------------------------------------------- conformance by instance
def test_the_local_engine_is_an_engine_that_does_not_fold():
    engine = LocalEngine()
    assert isinstance(engine, Engine)
    assert not isinstance(engine, IdentityFold)
    assert identity_fold(engine) is None
    engine.refuse()  # one rank: nothing to meet
    data = np.arange(4, dtype=np.float32)
    out = np.empty_like(data)
    engine.allreduce(data, out, BY_NAME["float32"], ReduceOp.SUM, data.shape)
    assert out.tolist() == data.tolist()


def test_a_shared_memory_engine_of_one_rank_folds():
    engine = ShmEngine(job_id=f"iface{os.getpid()}", host_index=0, local_rank=0,
                       local_size=1, global_rank=0, heap_bytes=1 << 20, token=1, timeout=5.0)
    try:
        assert isinstance(engine, Engine)
        assert isinstance(engine, IdentityFold)
        assert identity_fold(engine) is engine
        assert identity_fold(engine) is engine  # the per-class answer, cached
        desc = np.array([3, 1, 2], np.int64)
        assert engine.exchange_identity(desc).tolist() == [3, 1, 2]
    finally:
        engine.close()


# ------------------------------------------------------------------ no probing
PROBES = {"getattr", "hasattr"}
# what a probe would ask an engine (or its context) for; names any object has are left out
ENGINE_MEMBERS = ({*_members(Engine)[0], *_members(Engine)[1], *_members(IdentityFold)[0],
                   *_members(IdentityFold)[1], "ctx", "store", "multidim", "describe",
                   "cross_memory"} - {"name", "rank", "size", "close"})


def probes(source: str) -> list[str]:
    """``getattr``/``hasattr`` calls on something named like an engine, or asking for an
    engine's member by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in PROBES and len(node.args) >= 2):
            continue
        subject, attr = ast.unparse(node.args[0]), node.args[1]
        asked = attr.value if isinstance(attr, ast.Constant) else None
        if "engine" in subject.lower() or "ctx" in subject or asked in ENGINE_MEMBERS:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_probe_finder_finds_probes():
    sample = textwrap.dedent("""
        a = getattr(s.engine, "ctx", None)
        b = getattr(ctx, "store", None)
        c = hasattr(engine, "describe")
        d = getattr(thing, "fold_identity", None)
        e = getattr(libc, "process_vm_readv")
        f = getattr(exc, "refused", False)
    """)
    assert [p.split(": ")[0] for p in probes(sample)] == ["2", "3", "4", "5"]


def test_no_code_of_the_core_probes_an_engine():
    found = [f"{path.relative_to(CORE)}:{hit}" for path in sorted(CORE.rglob("*.py"))
             for hit in probes(path.read_text())]
    assert found == []
