"""The Kubernetes examples (examples/k8s/) against their schemas, and their commands
against ddlrun. Nothing here runs on a cluster.

- Built-in kinds (Service, Job) and every pod template: ``kubernetes-validate`` strict (the
  API's published JSON schemas; unknown fields are errors), for the oldest and newest
  Kubernetes versions we name.
- Kubeflow kinds (PyTorchJob, MPIJob of ``kubeflow.org/v1``): no CRD OpenAPI file ships in
  a package here, so they are checked against the Training Operator's own v1 API models from
  its SDK (``kubeflow-training``, generated from the operator's OpenAPI spec): every field
  must exist with the right type, required fields must be there (the models' own checks).
  The operator's defaulting and validating webhooks are not run.
- The container commands: ddlrun accepts them (``--dry-run`` for every node), the script
  exists, the image tag is this version's.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from ddlrun_testlib import PY, REPO

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
models = pytest.importorskip("kubeflow.training.models",
                             reason="pip install kubeflow-training (the v1 API models)")
from kubeflow.training import constants as kf  # noqa: E402
from kubernetes.client import models as k8s_models  # noqa: E402

K8S = REPO / "examples" / "k8s"
VERSIONS = ("1.27.0", "1.37.0")  # an older and the newest Kubernetes kubernetes-validate has
KUBEFLOW_MODELS = {"PyTorchJob": "KubeflowOrgV1PyTorchJob", "MPIJob": "KubeflowOrgV1MPIJob"}


def _version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"$', text, re.M)[1]


def docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in docs() if d["kind"] == kind]


# ---------------------------------------------------------------------------- schemas
def validate_builtin(doc: dict, version: str) -> None:
    kv.validate(doc, version, strict=True)


def validate_pod_template(template: dict, version: str) -> None:
    """A pod template through the built-in PodTemplate kind's schema."""
    validate_builtin({"apiVersion": "v1", "kind": "PodTemplate",
                      "metadata": {"name": "template"}, "template": template}, version)


class ModelError(Exception):
    pass


def check_model(value, type_name: str, path: str, templates: list[dict]):
    """``value`` (parsed YAML) as an instance of the OpenAPI model ``type_name``; unknown
    fields and wrong types raise ModelError naming the path. Pod templates are collected
    for kubernetes-validate. Returns the model object (its constructor checks required
    fields)."""
    if type_name in ("str", "int", "bool", "float"):
        kinds = {"str": str, "int": int, "bool": bool, "float": (int, float)}[type_name]
        if not isinstance(value, kinds) or (type_name == "int" and isinstance(value, bool)):
            raise ModelError(f"{path}: expected {type_name}, got {value!r}")
        return value
    if type_name in ("object", "datetime"):
        return value
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            raise ModelError(f"{path}: expected a mapping, got {value!r}")
        return {k: check_model(v, m[1], f"{path}.{k}", templates) for k, v in value.items()}
    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(value, list):
            raise ModelError(f"{path}: expected a list, got {value!r}")
        return [check_model(v, m[1], f"{path}[{i}]", templates) for i, v in enumerate(value)]
    cls = getattr(models, type_name, None) or getattr(k8s_models, type_name, None)
    if cls is None:
        raise ModelError(f"{path}: unknown model {type_name}")
    if not isinstance(value, dict):
        raise ModelError(f"{path}: expected a {type_name} mapping, got {value!r}")
    if type_name == "V1PodTemplateSpec":
        templates.append(value)
    fields = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ModelError(f"{path}: {type_name} has no field(s) {unknown} "
                         f"(it has {sorted(fields)})")
    kwargs = {fields[k]: check_model(v, cls.openapi_types[fields[k]], f"{path}.{k}", templates)
              for k, v in value.items()}
    try:
        return cls(**kwargs)
    except ValueError as exc:  # the model's own check: a required field is missing
        raise ModelError(f"{path}: {exc}") from None


def validate_kubeflow(doc: dict) -> list[dict]:
    """The doc against the v1 API; returns its pod templates."""
    if doc.get("apiVersion") != kf.API_VERSION:
        raise ModelError(f"apiVersion {doc.get('apiVersion')!r}: expected {kf.API_VERSION}")
    templates: list[dict] = []
    check_model(doc, KUBEFLOW_MODELS[doc["kind"]], doc["kind"], templates)
    return templates


@pytest.mark.parametrize("version", VERSIONS)
def test_builtin_kinds_validate_strictly(version):
    checked = []
    for name, doc in docs():
        if doc["kind"] in KUBEFLOW_MODELS:
            continue
        validate_builtin(doc, version)
        checked.append((name, doc["kind"]))
    assert ("indexed-job.yaml", "Job") in checked and ("indexed-job.yaml", "Service") in checked


@pytest.mark.parametrize("version", VERSIONS)
def test_kubeflow_kinds_match_the_training_operator_api(version):
    kinds = []
    for name, doc in docs():
        if doc["kind"] not in KUBEFLOW_MODELS:
            continue
        templates = validate_kubeflow(doc)
        assert templates, name
        for template in templates:
            validate_pod_template(template, version)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["MPIJob", "PyTorchJob"]


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["spec"].update(pytorchReplicaSpec=d["spec"].pop("pytorchReplicaSpecs")),
     "has no field(s) ['pytorchReplicaSpec']"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="1"),
     "Worker.replicas: expected int"),
    (lambda d: d["spec"].pop("pytorchReplicaSpecs"), "pytorch_replica_specs"),
    (lambda d: d["spec"]["runPolicy"].update(cleanPodPolicy=["Running"]),
     "cleanPodPolicy: expected str"),
])
def test_the_kubeflow_check_catches_mistakes(mutate, message):
    doc = copy.deepcopy(by_kind("PyTorchJob")[0])
    mutate(doc)
    with pytest.raises(ModelError, match=re.escape(message)):
        validate_kubeflow(doc)


def test_the_pod_template_check_catches_mistakes():
    template = copy.deepcopy(by_kind("PyTorchJob")[0]["spec"]["pytorchReplicaSpecs"]["Master"]
                             ["template"])
    template["spec"]["containers"][0]["ports"][0]["containerPort"] = "23456"
    with pytest.raises(kv.ValidationError):
        validate_pod_template(template, VERSIONS[-1])
    template = copy.deepcopy(by_kind("MPIJob")[0]["spec"]["mpiReplicaSpecs"]["Worker"]
                             ["template"])
    template["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        validate_pod_template(template, VERSIONS[-1])


# ---------------------------------------------------------------------------- conventions
def containers(doc: dict) -> list[dict]:
    specs = doc["spec"].get("pytorchReplicaSpecs") or doc["spec"].get("mpiReplicaSpecs")
    templates = [r["template"] for r in specs.values()] if specs else [doc["spec"]["template"]]
    return [c for t in templates for c in t["spec"]["containers"]]


def test_every_pod_runs_this_versions_image_and_a_script_that_exists():
    image = f"powerddl:cpu-{_version()}"
    seen = 0
    for _, doc in docs():
        if doc["kind"] == "Service":
            continue
        for c in containers(doc):
            assert c["image"] == image, (doc["kind"], c["image"])
            seen += 1
            scripts = [a for a in c.get("args", []) if a.endswith(".py")]
            for script in scripts:  # the image's WORKDIR is /opt/powerddl, holding examples/
                assert (REPO / script).is_file(), script
    assert seen == 5  # PyTorchJob master + worker, MPIJob launcher + worker, Job


def test_pytorchjob_follows_the_operators_conventions():
    job = by_kind("PyTorchJob")[0]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {kf.REPLICA_TYPE_MASTER, kf.REPLICA_TYPE_WORKER}
    assert specs["Master"]["replicas"] == 1  # RANK (node rank) 0 is the Master pod
    for c in containers(job):
        assert c["name"] == kf.PYTORCHJOB_CONTAINER
        assert any(p["name"] == "pytorchjob-port" for p in c["ports"])  # -> MASTER_PORT


def test_mpijob_asks_for_as_many_ranks_as_worker_slots():
    job = by_kind("MPIJob")[0]
    specs = job["spec"]["mpiReplicaSpecs"]
    assert set(specs) == {kf.REPLICA_TYPE_LAUNCHER, kf.REPLICA_TYPE_WORKER}
    launcher = specs["Launcher"]["template"]["spec"]["containers"][0]
    args = launcher["args"]
    ranks = specs["Worker"]["replicas"] * job["spec"]["slotsPerWorker"]
    assert launcher["command"] == ["mpirun"] and args[args.index("-np") + 1] == str(ranks)
    assert args[args.index("--hostfile") + 1] == "/etc/mpi/hostfile"
    assert all(c["name"] == kf.MPIJOB_CONTAINER for c in containers(job))


def test_indexed_job_and_its_headless_service_agree():
    job, svc = by_kind("Job")[0], by_kind("Service")[0]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]  # every node at once
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == svc["metadata"]["name"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--nnodes") + 1] == str(spec["completions"])
    # rank 0 lives on the pod of index 0, named <job>-0.<service>
    assert args[args.index("--master-addr") + 1] == (f"{job['metadata']['name']}-0."
                                                      f"{svc['metadata']['name']}")
    store = {p["containerPort"] for p in pod["containers"][0]["ports"]}
    port = int(args[args.index("--master-port") + 1])
    assert {port, port + 1} <= store  # MASTER_PORT and ddl's store (MASTER_PORT + 1)


# ---------------------------------------------------------------------------- commands
def ddlrun_nodes(doc: dict) -> list[tuple[list[str], dict[str, str]]]:
    """Each node's ddlrun argv, with $(VAR) as the operator / Job controller would fill it."""
    c = containers(doc)[0]
    if doc["kind"] == "PyTorchJob":
        n = sum(r["replicas"] for r in doc["spec"]["pytorchReplicaSpecs"].values())
        name = doc["metadata"]["name"]
        values = [{"RANK": str(i), "MASTER_ADDR": f"{name}-master-0", "MASTER_PORT": "23456"}
                  for i in range(n)]
    else:
        values = [{"JOB_COMPLETION_INDEX": str(i)} for i in range(doc["spec"]["completions"])]
    out = []
    for env in values:
        argv = [re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m[1]], a) for a in c["args"]]
        out.append((argv, env))
    return out


@pytest.mark.parametrize("kind", ["PyTorchJob", "Job"])
def test_ddlrun_accepts_every_nodes_command(kind):
    doc = by_kind(kind)[0]
    nodes = ddlrun_nodes(doc)
    assert containers(doc)[0]["command"] == ["ddlrun"] and len(nodes) == 2
    for node, (argv, _) in enumerate(nodes):
        res = subprocess.run([PY, "-m", "ddlrun", "--dry-run", *argv], capture_output=True,
                             text=True, timeout=60, cwd=str(REPO),
                             env={"PATH": "/usr/bin:/bin", "DDL_JOB_SECRET_FILE": "/dev/null"})
        assert res.returncode == 0, res.stdout + res.stderr
        # torchrun's rule: this node's 2 ranks are RANK 2K and 2K+1 of WORLD_SIZE 4
        assert "WORLD_SIZE=4" in res.stdout, res.stdout
        for local in range(2):
            assert re.search(rf"\[{2 * node + local}\] env: .*\bGROUP_RANK={node}\b",
                             res.stdout), res.stdout
        master = argv[argv.index("--master-addr") + 1]
        assert f"MASTER_ADDR={master}" in res.stdout


def test_the_readme_lists_every_manifest():
    text = (K8S / "README.md").read_text()
    for path in K8S.glob("*.yaml"):
        assert f"`{path.name}`" in text, path.name
    assert "not run on a cluster" in text


def test_manifests_are_found():
    names = {Path(n).name for n, _ in docs()}
    assert names == {"pytorchjob.yaml", "mpijob.yaml", "indexed-job.yaml"}
