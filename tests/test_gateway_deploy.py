"""The gateway as shipped: its compose service beside the worker, its
Kubernetes manifests (validated against the cluster's schemas, strict),
Prometheus scraping it, the status page inside the package, and the
command's start-up errors as one line."""

from __future__ import annotations

import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import yaml

from jaxserve.gateway.app import routes

REPO = Path(__file__).resolve().parents[1]
GATEWAY_K8S = REPO / "ops" / "k8s" / "gateway" / "gateway.yaml"


def flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def test_compose_runs_the_gateway_beside_the_worker():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    gateway, worker = services["gateway"], services["worker"]
    cmd = gateway["command"]
    assert cmd[0] == "gateway" and gateway["image"] == worker["image"]
    for same in ("--amqp-url", "--redis-url"):
        assert flag(cmd, same) == flag(worker["command"], same), same  # one broker, one Redis
    assert flag(cmd, "--store") == "redis" and flag(cmd, "--host") == "0.0.0.0"
    port = flag(cmd, "--port")
    assert f"{port}:{port}" in gateway["ports"]
    files = flag(cmd, "--files-dir")
    assert any(v.endswith(f":{files}") for v in gateway["volumes"])
    assert "/readyz" in " ".join(gateway["healthcheck"]["test"])
    management = flag(cmd, "--management-url")
    assert management.startswith("http://") and "@rabbitmq:15672" in management
    assert "15672:15672" in services["rabbitmq"]["ports"]
    prometheus = yaml.safe_load((REPO / "ops" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    assert jobs["jaxserve-gateway"]["static_configs"][0]["targets"] == [f"gateway:{port}"]


def test_kubernetes_manifests_validate_and_replicas_share_their_state():
    docs = [d for d in yaml.safe_load_all(GATEWAY_K8S.read_text()) if d]
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"Deployment", "Service", "PersistentVolumeClaim"}
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "gateway" and flag(args, "--host") == "0.0.0.0"
    port = int(flag(args, "--port"))
    assert container["ports"][0]["containerPort"] == port
    assert by_kind["Service"]["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    assert by_kind["Service"]["spec"]["selector"] == by_kind["Deployment"]["spec"]["selector"]["matchLabels"]
    # several replicas: Redis for batches and files, one shared folder for the files
    assert by_kind["Deployment"]["spec"]["replicas"] > 1 and flag(args, "--store") == "redis"
    files = flag(args, "--files-dir")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == files)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = by_kind["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    env = {e["name"] for e in container["env"]}
    assert {"JAXSERVE_AMQP_URL", "JAXSERVE_REDIS_URL"} <= env
    paths = {r.path for r in routes()}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in paths


def test_the_status_page_ships_in_the_package():
    import importlib.resources

    page = importlib.resources.files("jaxserve.gateway").joinpath("static/status.html").read_text()
    assert "status.json" in page and "<script" in page
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "static/*" in pyproject["tool"]["setuptools"]["package-data"]["jaxserve.gateway"]


def _gateway(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.cli.main", "gateway", *args], capture_output=True, text=True, timeout=60
    )


def test_start_up_mistakes_are_one_line(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  sk-abcdefgh: {tenant: a, priority: high}\n")
    proc = _gateway("--keys", str(keys))
    assert proc.returncode == 1 and "priority" in proc.stderr and "Traceback" not in proc.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = _gateway("--port", str(busy.getsockname()[1]))
    assert proc.returncode == 1 and "--port" in proc.stderr and "Traceback" not in proc.stderr
    proc = _gateway("--amqp-url", "amqp://guest:guest@127.0.0.1:1/")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
