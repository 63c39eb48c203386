"""deploy/k8s: rendered with kubectl's kustomize, every object validated, and tied to the code.

No cluster runs here. What keeps the manifests honest:
  * `kubectl kustomize` renders the base, the queue-depth component and the training job;
  * kubernetes-validate --strict (schemas bundled, offline) checks every built-in object against
    the oldest and newest Kubernetes it knows here (unknown keys are errors), and the PyTorchJob,
    a custom resource it cannot check, is checked here: its shape, and its pod template as a
    real PodTemplate;
  * probes, ports and environment names are compared with the FastAPI app's routes, the CLI's
    flags and api/settings.py; Redis's policy with docker-compose.yml's.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE_FILE = ROOT / "docker-compose.yml"
# kubectl 1.32 renders here; the validator bundles schemas up to its own newest version
VERSIONS = ("1.32.0", kubernetes_validate.utils.latest_version())
pytestmark = pytest.mark.slow  # kubectl subprocesses


def kustomize(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/k8s (it bundles kustomize)"
    proc = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return kustomize(K8S)


def by_kind(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    found = [o for o in objects if o["kind"] == kind]
    return [o for o in found if o["metadata"]["name"] == name] if name else found


def one(objects: list[dict], kind: str, name: str) -> dict:
    (obj,) = by_kind(objects, kind, name)
    return obj


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def container(obj: dict, name: str) -> dict:
    (c,) = [c for c in pod_spec(obj)["containers"] if c["name"] == name]
    return c


def env_of(objects: list[dict], c: dict) -> dict[str, str]:
    """A container's environment: its ConfigMaps (rendered with it) and its own entries."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env |= one(objects, "ConfigMap", src["configMapRef"]["name"])["data"]
    return env | {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def validate(obj: dict) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


# --------------------------------------------------------------------------- render + validate


def test_base_renders_the_expected_objects(objects):
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    expected = {
        ("Namespace", "elmo"),
        ("Deployment", "api"),
        ("Service", "api"),
        ("PodDisruptionBudget", "api"),
        ("HorizontalPodAutoscaler", "api"),
        ("Deployment", "worker"),
        ("StatefulSet", "redis"),
        ("Service", "redis"),
        ("NetworkPolicy", "redis"),
        ("PersistentVolumeClaim", "models"),
        ("PersistentVolumeClaim", "data"),
        ("PersistentVolumeClaim", "runs"),
    }
    assert expected <= set(kinds), expected - set(kinds)
    assert [k for k, n in kinds if k == "ConfigMap"] == ["ConfigMap"]
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "elmo", o["metadata"]


def test_every_object_validates_strictly(objects):
    for obj in objects:
        validate(obj)


def test_strict_validation_is_really_checking(objects):
    """A misspelt key and a wrong type must both fail (guards against a validator that passes all)."""
    api = copy.deepcopy(one(objects, "Deployment", "api"))
    container(api, "api")["readinessProbes"] = container(api, "api").pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(api)
    api = copy.deepcopy(one(objects, "Deployment", "api"))
    api["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(api)


def test_queue_depth_component(tmp_path):
    """Switched on as docs/deploy.md says, the HPA also follows the queue-depth gauge."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    kustomization = tree / "kustomization.yaml"
    kustomization.write_text(
        kustomization.read_text() + "\ncomponents:\n  - components/queue-depth-hpa\n"
    )
    objects = kustomize(tree)
    hpa = one(objects, "HorizontalPodAutoscaler", "api")
    validate(hpa)
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert metrics["Pods"]["pods"]["metric"]["name"] == "elmo_queue_depth"
    # the gauge the adapter must serve exists under that name in /metrics
    from elmo_api.metrics import Metrics

    assert b"elmo_queue_depth " in Metrics().render()[0]


# --------------------------------------------------------------------------- tied to the code


@pytest.fixture(scope="module")
def routes() -> set[str]:
    """Paths the FastAPI app answers with GET (from its OpenAPI schema)."""
    from elmo_api.main import create_app

    paths = create_app().openapi()["paths"]
    return {path for path, ops in paths.items() if "get" in ops}


def test_api_probes_ports_and_command(objects, routes):
    api = one(objects, "Deployment", "api")
    c = container(api, "api")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["args"] == ["serve", "--host", "0.0.0.0", "--port", str(ports["http"])]
    assert c["image"].startswith("elmo-service")
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert probe["path"] in routes, probe
        assert probe["port"] in ports or probe["port"] in ports.values()
    assert probes["startupProbe"]["path"] == probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/healthz", "liveness must not depend on the model"
    # the startup probe allows for model load + warm-up before liveness can kill the pod
    s = c["startupProbe"]
    assert s["periodSeconds"] * s["failureThreshold"] >= 180
    # the Service reaches these pods on that port
    svc = one(objects, "Service", "api")
    labels = api["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] in ports
    # the scrape annotation points at the real metrics route
    notes = api["spec"]["template"]["metadata"]["annotations"]
    assert (
        notes["prometheus.io/path"] in routes and int(notes["prometheus.io/port"]) == ports["http"]
    )


def test_environment_names_are_settings(objects):
    """Every ELMO_* given to a pod is a field of api/settings.py (a misspelt one is ignored)."""
    from elmo_api.settings import ENV_PREFIX, Settings

    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    known |= {"REDIS_URL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NPROC"}
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    for obj in workloads:
        for c in pod_spec(obj)["containers"]:
            unknown = set(env_of(objects, c)) - known
            assert not unknown, (obj["metadata"]["name"], unknown)
    assert ENV_PREFIX == "ELMO_"


@pytest.mark.parametrize("name", ["api", "worker"])
def test_threads_match_the_cpu_request(objects, name):
    obj = one(objects, "Deployment", name)
    c = container(obj, name)
    env = env_of(objects, c)
    cpu = c["resources"]["requests"]["cpu"]
    assert re.fullmatch(r"\d+", str(cpu)), f"{name}: a whole number of cores, got {cpu}"
    assert env["ELMO_THREADS"] == env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(cpu)
    assert c["resources"]["limits"]["cpu"] == cpu, "a CPU limit below the threads throttles them"


def test_shared_settings(objects):
    env = one(objects, "ConfigMap", by_kind(objects, "ConfigMap")[0]["metadata"]["name"])["data"]
    redis_svc = one(objects, "Service", "redis")
    (port,) = redis_svc["spec"]["ports"]
    assert env["REDIS_URL"] == f"redis://redis:{port['port']}/0"
    mounts = {
        m["name"]: m["mountPath"]
        for m in container(one(objects, "Deployment", "api"), "api")["volumeMounts"]
    }
    assert env["ELMO_MODELS_DIR"] == mounts["models"]
    assert env["ELMO_DATA_DIR"] == mounts["data"] and env["ELMO_RUNS_DIR"] == mounts["runs"]


def test_volumes_are_shared_and_declared(objects):
    claims = {o["metadata"]["name"]: o for o in by_kind(objects, "PersistentVolumeClaim")}
    for name in ("models", "data", "runs"):
        assert claims[name]["spec"]["accessModes"] == ["ReadWriteMany"], name
    for obj in by_kind(objects, "Deployment"):
        for vol in pod_spec(obj)["volumes"]:
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims


def test_worker(objects):
    worker = one(objects, "Deployment", "worker")
    c = container(worker, "worker")
    assert c["args"] == ["worker"]
    compose = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["worker"]
    assert c["livenessProbe"]["exec"]["command"] == compose["healthcheck"]["test"][1:]
    assert pod_spec(worker)["terminationGracePeriodSeconds"] >= 60


def test_redis_has_the_compose_policy(objects):
    args = container(one(objects, "StatefulSet", "redis"), "redis")["args"]
    compose = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["redis"]["command"]

    def opt(cmd: list[str], flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    for flag in (
        "--protected-mode",
        "--appendonly",
        "--appendfsync",
        "--maxmemory-policy",
        "--maxmemory-samples",
        "--dir",
    ):
        assert opt(args, flag) == opt(compose, flag), flag
    assert opt(args, "--maxmemory-policy") == "volatile-lru" and opt(args, "--appendonly") == "yes"
    assert "${REDIS_MAXMEMORY:-" + opt(args, "--maxmemory") + "}" == opt(compose, "--maxmemory")
    sts = one(objects, "StatefulSet", "redis")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = container(sts, "redis")["volumeMounts"]
    assert [m["mountPath"] for m in mounts if m["name"] == claim["metadata"]["name"]] == ["/data"]


def test_only_api_and_worker_reach_redis(objects):
    policy = one(objects, "NetworkPolicy", "redis")
    sts = one(objects, "StatefulSet", "redis")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        sts["spec"]["template"]["metadata"]["labels"].items()
    )
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    (expr,) = peer["podSelector"]["matchExpressions"]
    names = {
        o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for o in (one(objects, "Deployment", "api"), one(objects, "Deployment", "worker"))
    }
    assert (expr["key"], expr["operator"], set(expr["values"])) == (
        "app.kubernetes.io/name", "In", names
    )  # fmt: skip
    (port,) = rule["ports"]
    assert port["port"] == container(sts, "redis")["ports"][0]["containerPort"]


def test_disruption_budget_and_autoscaler_fit_the_deployment(objects):
    api = one(objects, "Deployment", "api")
    pdb = one(objects, "PodDisruptionBudget", "api")
    hpa = one(objects, "HorizontalPodAutoscaler", "api")
    labels = api["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "api")
    # a drain can always evict one pod: the autoscaler's floor is above the budget's
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["minAvailable"]
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert api["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_seed_models_init_container(objects, tmp_path):
    """The init container's script, run here: seeds an empty volume once, leaves a seeded one."""
    (init,) = pod_spec(one(objects, "Deployment", "api"))["initContainers"]
    assert init["command"][:2] == ["sh", "-c"]
    assert [m["mountPath"] for m in init["volumeMounts"]] == ["/seed"]
    script = init["command"][2]
    image_models, volume = tmp_path / "image-models", tmp_path / "volume"
    shutil.copytree(ROOT / "models" / "default", image_models / "default")
    volume.mkdir()
    script = script.replace("/models/", f"{image_models}/").replace("/seed", str(volume))

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)

    assert run().returncode == 0
    manifest = volume / "default" / "manifest.json"
    assert manifest.read_bytes() == (ROOT / "models/default/manifest.json").read_bytes()
    manifest.write_text('{"kept": true}')  # a seeded volume is never overwritten
    assert run().returncode == 0 and json.loads(manifest.read_text()) == {"kept": True}
    assert sorted(p.name for p in volume.iterdir()) == ["default"], "no partial copies left"


# --------------------------------------------------------------------------- hardening


def pods(objects: list[dict], job: dict) -> list[tuple[str, dict]]:
    """(name, pod spec) of every workload: the base's and the training job's ranks."""
    found = []
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            spec = copy.deepcopy(pod_spec(o))  # a StatefulSet's claims are volumes too
            claims = o["spec"].get("volumeClaimTemplates", [])
            spec["volumes"] = spec.get("volumes", []) + [
                {"name": t["metadata"]["name"], "persistentVolumeClaim": {}} for t in claims
            ]
            found.append((o["metadata"]["name"], spec))
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        found.append((f"pytorchjob/{role}", spec["template"]["spec"]))
    return found


def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def test_every_container_has_a_read_only_root(objects, job):
    """Writes go to declared volumes only; elmo's containers get an emptyDir /tmp."""
    for name, spec in pods(objects, job):
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in all_containers(spec):
            where = f"{name}/{c['name']}"
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, where
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (where, m)
            if c["image"].startswith("elmo-service") and c in spec["containers"]:
                (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
                assert "emptyDir" in volumes[tmp["name"]], (where, "a writable /tmp")


def secret_refs(spec: dict) -> list[tuple[str, dict]]:
    refs = []
    for c in all_containers(spec):
        refs += [(c["name"], s["secretRef"]) for s in c.get("envFrom", []) if "secretRef" in s]
        for e in c.get("env", []):
            if "secretKeyRef" in e.get("valueFrom", {}):
                refs.append((c["name"], e["valueFrom"]["secretKeyRef"]))
    return refs


def test_secrets_are_required_fail_closed(objects, job):
    """A missing Secret keeps the pod from starting: it never runs with open routes."""
    for name, spec in pods(objects, job):
        for container_name, ref in secret_refs(spec):
            assert not ref.get("optional", False), (name, container_name, ref)
    for name in ("api", "worker"):
        c = container(one(objects, "Deployment", name), name)
        assert {"secretRef": {"name": "elmo-keys"}} in c["envFrom"], name


def secret_env(c: dict, name: str) -> dict:
    (entry,) = [e for e in c.get("env", []) if e["name"] == name]
    return entry["valueFrom"]["secretKeyRef"]


def test_redis_has_a_password_every_client_is_given(objects):
    sts = one(objects, "StatefulSet", "redis")
    redis = container(sts, "redis")
    args = redis["args"]
    assert args[args.index("--protected-mode") + 1] == "yes"
    # $(VAR) in args is expanded by the kubelet from the container's own environment
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    source = secret_env(redis, "REDIS_PASSWORD")
    assert source == {"name": "redis-auth", "key": "password"}
    assert secret_env(redis, "REDISCLI_AUTH") == source, "the probes' redis-cli authenticates"
    assert all(
        "redis-cli" in redis[p]["exec"]["command"] for p in ("readinessProbe", "livenessProbe")
    )
    for name in ("api", "worker"):  # every pod that reaches Redis (the NetworkPolicy's list)
        c = container(one(objects, "Deployment", name), name)
        assert secret_env(c, "ELMO_REDIS_PASSWORD") == source, name
    probe = container(one(objects, "Deployment", "worker"), "worker")["livenessProbe"]
    assert "password=os.environ.get('ELMO_REDIS_PASSWORD')" in probe["exec"]["command"][-1]


def test_no_replicas_beside_an_autoscaler(objects):
    """An HPA's Deployment has no `replicas`: every `apply -k` would scale a grown fleet back."""
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    assert hpas
    for hpa in hpas:
        target = one(
            objects, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"]
        )
        assert "replicas" not in target["spec"], target["metadata"]["name"]


def test_images_are_pinned(objects, job):
    """No `latest`: the project's image carries the project's version, others a fixed tag."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for name, spec in pods(objects, job):
        for c in all_containers(spec):
            image, _, tag = c["image"].rpartition(":")
            assert image and tag and tag != "latest", (name, c["image"])
            if image == "elmo-service":
                assert tag == version, (name, c["image"], version)


# --------------------------------------------------------------------------- training job


@pytest.fixture(scope="module")
def job() -> dict:
    (obj,) = kustomize(K8S / "training")
    return obj


def test_pytorchjob_shape(job, objects):
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["namespace"] == "elmo"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    claims = {o["metadata"]["name"]: o for o in by_kind(objects, "PersistentVolumeClaim")}
    for role, spec in specs.items():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode"), role
        # the pod template is a real one: validate it as a PodTemplate
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"elmo-pretrain-{role.lower()}"},
            "template": spec["template"],
        }
        validate(template)
        (c,) = spec["template"]["spec"]["containers"]
        assert c["name"] == "pytorch", "the training operator looks for this container name"
        for vol in spec["template"]["spec"]["volumes"]:
            if "persistentVolumeClaim" in vol:  # shared by every rank: the base's RWX claims
                claim = claims[vol["persistentVolumeClaim"]["claimName"]]
                assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_pytorchjob_command(job):
    """torchrun's flags agree with the job, and pretrain's CLI accepts the training command."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    (c,) = specs["Master"]["template"]["spec"]["containers"]
    assert c["command"] == ["sh", "-c"]
    env = {e["name"]: e["value"] for e in c["env"]}
    words = shlex.split(c["args"][0].replace("$NPROC", env["NPROC"]))
    assert words[:2] == ["exec", "torchrun"]
    module = words.index("-m")
    flags = dict(w.lstrip("-").split("=", 1) for w in words[2:module] if "=" in w)
    assert int(flags["nnodes"]) == sum(s["replicas"] for s in specs.values())
    assert flags["rdzv-backend"] == "c10d"
    host, port = flags["rdzv-endpoint"].rsplit(":", 1)
    assert host == "$MASTER_ADDR" and int(port) in {p["containerPort"] for p in c["ports"]}
    assert words[module + 1] == "elmo_pretrain.cli"
    from elmo_pretrain.cli import build_parser

    args = build_parser().parse_args(words[module + 2 :])
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert args.resume, "a restarted rank must continue from the newest checkpoint"
    assert any(args.run_dir.startswith(m + "/") for m in mounts), "the run folder must be shared"
    assert any(args.config.startswith(m + "/") for m in mounts)
    (data,) = [o.split("=", 1)[1] for o in args.overrides if o.startswith("data.path=")]
    assert any(data.startswith(m + "/") for m in mounts)
    assert specs["Worker"]["template"] == specs["Master"]["template"]
