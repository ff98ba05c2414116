"""The deployment as shipped: the wheel, the image recipe, docker-compose,
Prometheus, Grafana and Kubernetes.

* The wheel is built from exactly what the Dockerfile's build stage copies,
  installed into a fresh virtual environment (no --system-site-packages),
  and ``jaxserve generate`` runs from a folder outside the repository: the
  model presets must come from the wheel. To stay fast and offline the wheel
  is installed with ``--no-deps`` and the fresh environment reaches the
  third-party dependencies through a ``.pth`` file naming this environment's
  site-packages (it only adds that folder to ``sys.path``: its own ``.pth``
  files, among them the editable install's finder, are not run, and the
  fresh site-packages comes first, so ``jaxserve`` is the wheel's).
* Manifests are checked against schemas, offline: Kubernetes kinds with the
  schemas bundled by ``kubernetes-validate`` (strict: unknown fields fail),
  KEDA's kinds and the compose file with schemas vendored under
  ``tests/data/deploy/`` (sources in SOURCES.md there).
* Every PromQL expression of the dashboard and the alerts is parsed
  (``promql-parser``) and may only name series that a worker exports (its
  ``EngineMetrics`` registry), that RabbitMQ exports under the shipped scrape
  configuration, or that Prometheus adds itself. ``promtool`` checks the
  rules and the config when it is on PATH.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "deploy"
OPS = REPO / "ops"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in an argv list."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def duration_s(text: str) -> float:
    """A compose/Go duration (``60s``, ``1m30s``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[u] for n, u in parts)


# ------------------------------------------------------------------ Dockerfile
def dockerfile_stages() -> list[dict[str, Any]]:
    stages: list[dict[str, Any]] = []
    text = (OPS / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            parts = rest.split()
            stages.append({"from": parts[0], "name": parts[2] if len(parts) > 2 else None, "lines": []})
        elif stages:
            stages[-1]["lines"].append((word, rest.strip()))
    return stages


def build_stage_copies() -> list[tuple[list[str], str]]:
    build = dockerfile_stages()[0]
    copies = []
    for word, rest in build["lines"]:
        if word == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            copies.append((parts[:-1], parts[-1]))
    return copies


def test_dockerfile_builds_a_wheel_then_installs_it():
    stages = dockerfile_stages()
    assert len(stages) == 2, "a build stage and a runtime stage"
    build, runtime = stages
    assert build["name"] == "build"
    build_runs = " ".join(rest for word, rest in build["lines"] if word == "RUN")
    assert "pip wheel" in build_runs and "--no-deps" in build_runs
    runtime_lines = {w: r for w, r in runtime["lines"] if w in ("ENTRYPOINT", "CMD", "USER")}
    assert any(w == "COPY" and "--from=build" in r for w, r in runtime["lines"])
    runtime_runs = " ".join(rest for word, rest in runtime["lines"] if word == "RUN")
    assert "pip install" in runtime_runs and ".whl" in runtime_runs
    whole = (OPS / "docker" / "Dockerfile").read_text()
    assert not re.search(r"pip install[^\n]*(\s-e\s|--editable)", whole), "no editable install in the image"
    # The runtime stage has no source tree, only the installed wheel.
    assert not [r for w, r in runtime["lines"] if w == "COPY" and "--from=build" not in r]
    assert json.loads(runtime_lines["ENTRYPOINT"]) == ["jaxserve"]
    assert json.loads(runtime_lines["CMD"])[0] == "worker"
    assert runtime_lines["USER"] not in ("root", "0")
    for sources, _dest in build_stage_copies():
        for src in sources:
            assert (REPO / src).exists(), src


def test_dockerignore_keeps_the_context_small_but_not_what_the_build_copies():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in (".git", ".venv", "benchmarks/results", "**/__pycache__", ".pytest_cache"):
        assert needed in patterns, needed
    copied = {src.rstrip("/") for sources, _ in build_stage_copies() for src in sources}
    for pattern in patterns:
        for src in copied:
            assert pattern.rstrip("/") != src and not src.startswith(pattern.rstrip("/") + "/"), (pattern, src)


# ----------------------------------------------------------------------- wheel
def test_presets_have_one_source_of_truth():
    """jaxserve/preset_data is models/ itself (a symlink), never a copy that
    could drift from it."""
    link = REPO / "jaxserve" / "preset_data"
    assert link.is_symlink() and os.readlink(link) == "../models"
    from jaxserve import presets

    assert presets.presets_dir() == (REPO / "models").resolve()


def test_wheel_carries_the_presets_and_runs_outside_the_repository(tmp_path):
    # 1. the build context, exactly as the Dockerfile's build stage copies it
    src = tmp_path / "src"
    for sources, dest in build_stage_copies():
        for item in sources:
            target = src / (item if dest in ("./", ".") else dest)
            origin = REPO / item
            if origin.is_dir():
                # symlinks kept, as docker's COPY keeps them
                shutil.copytree(origin, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dist), "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("jaxserve-*.whl")

    # 2. what is inside: every preset file, every package, nothing top-level but jaxserve
    names = set(zipfile.ZipFile(wheel).namelist())
    for file in (REPO / "models").rglob("*"):
        if file.is_file():
            rel = file.relative_to(REPO / "models").as_posix()
            assert f"jaxserve/preset_data/{rel}" in names, f"models/{rel} is not in the wheel"
    for init in (REPO / "jaxserve").rglob("__init__.py"):
        rel = init.relative_to(REPO).as_posix()
        assert rel in names, f"package {init.parent.relative_to(REPO)} is missing from the wheel"
    assert "jaxserve/kernels/cpu/paged_attention_cpu.cc" in names, "the CPU kernel's source is not in the wheel"
    assert {n.split("/", 1)[0] for n in names} == {"jaxserve", f"jaxserve-{VERSION}.dist-info"}

    # 3. a fresh environment with only the wheel installed
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    site = Path(
        subprocess.run(
            [str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz-test-deps.pth").write_text("\n".join(sorted(deps)) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXSERVE_", "PYTHON"))}
    env["JAXSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    where = subprocess.run(
        [
            str(vpy),
            "-c",
            "import jaxserve, jaxserve.presets as p; print(jaxserve.__file__); print(p.presets_dir()); print(p.list_presets())",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    module_file, presets_dir, listed = where.stdout.splitlines()
    assert Path(module_file).is_relative_to(venv), module_file
    assert Path(presets_dir) == Path(module_file).parent / "preset_data"
    assert "tiny" in listed

    # 4. the console script, from outside the repository
    run = subprocess.run(
        [str(venv / "bin" / "jaxserve"), "generate", "--max-tokens", "3", "hi"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip(), "generate printed no text"
    assert "Traceback" not in run.stderr
    # the packaged preset is byte-identical to models/: same cache folder name
    from jaxserve.presets import preset_hash

    assert (tmp_path / "cache" / "presets" / f"tiny-{preset_hash(REPO / 'models' / 'tiny.json')}").is_dir()


# ---------------------------------------------------------------- compose
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_file_matches_the_compose_spec(compose):
    schema = json.loads((DATA / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER).validate(compose)
    with pytest.raises(jsonschema.ValidationError):  # the schema really checks services
        jsonschema.Draft7Validator(schema).validate({"services": {"w": {"stop_grace_period": 60, "no_such_key": 1}}})


def test_compose_runs_rabbitmq_4_redis_worker_prometheus_grafana(compose):
    services = compose["services"]
    assert set(services) >= {"rabbitmq", "redis", "worker", "prometheus", "grafana"}
    image = services["rabbitmq"]["image"]
    assert re.match(r"rabbitmq:4\.\d+", image), image
    for name, svc in services.items():
        if "image" in svc:
            assert ":" in svc["image"] and not svc["image"].endswith(":latest"), (name, svc["image"])

    worker = services["worker"]
    cmd = worker["command"]
    assert cmd[0] == "worker"
    assert flag(cmd, "--store") == "redis"
    redis_url = flag(cmd, "--redis-url")
    assert redis_url and redis_url.startswith("redis://redis:"), redis_url
    assert flag(cmd, "--amqp-url").startswith("amqp://") and "@rabbitmq:5672" in flag(cmd, "--amqp-url")
    assert flag(cmd, "--metrics-port") == "9400"
    drain = float(flag(cmd, "--drain-timeout") or 30.0)  # the CLI's default is 30 s
    assert duration_s(worker["stop_grace_period"]) > drain
    assert worker["build"]["dockerfile"] == "ops/docker/Dockerfile"
    assert worker["image"] == f"jaxserve:{VERSION}"
    assert worker["depends_on"]["rabbitmq"]["condition"] == "service_healthy"

    # every bind mount names a file or folder of the repository
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            host = vol.split(":", 1)[0]
            if host.startswith("./"):
                assert (REPO / host).exists(), (name, host)
    plugins = (OPS / "rabbitmq" / "enabled_plugins").read_text()
    assert "rabbitmq_prometheus" in plugins
    assert any(v.endswith(":/etc/rabbitmq/enabled_plugins:ro") for v in services["rabbitmq"]["volumes"])
    assert "15692:15692" in services["rabbitmq"]["ports"]
    grafana_mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"] if v.startswith("./")}
    assert grafana_mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboard_dir = str(Path(grafana_mounts["./ops/grafana/jaxserve-dashboard.json"]).parent)
    provider = yaml.safe_load((OPS / "grafana/provisioning/dashboards/jaxserve.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == dashboard_dir
    assert any(v.startswith("./ops/prometheus:/etc/prometheus") for v in services["prometheus"]["volumes"])


# -------------------------------------------------------------- prometheus
@pytest.fixture(scope="module")
def prometheus() -> dict:
    return yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())


def scrape_jobs(prometheus) -> dict[str, dict]:
    return {job["job_name"]: job for job in prometheus["scrape_configs"]}


def test_prometheus_scrapes_the_workers_and_rabbitmq(prometheus, compose):
    jobs = scrape_jobs(prometheus)
    worker_port = int(flag(compose["services"]["worker"]["command"], "--metrics-port"))
    (sd,) = jobs["jaxserve-worker"]["dns_sd_configs"]
    assert sd["names"] == ["worker"] and sd["port"] == worker_port
    aggregated = jobs["rabbitmq"]
    assert aggregated.get("metrics_path", "/metrics") == "/metrics"
    assert aggregated["static_configs"][0]["targets"] == ["rabbitmq:15692"]
    detailed = jobs["rabbitmq-queues"]
    assert detailed["metrics_path"] == "/metrics/detailed"
    assert "queue_coarse_metrics" in detailed["params"]["family"]
    assert detailed["static_configs"][0]["targets"] == ["rabbitmq:15692"]
    for rule_file in prometheus["rule_files"]:
        assert (OPS / "prometheus" / rule_file).is_file()


# RabbitMQ's series, from rabbitmq-server deps/rabbitmq_prometheus/src/collectors/
# prometheus_rabbitmq_core_metrics_collector.erl (METRICS_RAW and TOTALS): the
# same table feeds /metrics (prefix rabbitmq_, aggregated over objects) and
# /metrics/detailed (prefix rabbitmq_detailed_, per object, only the families
# named in ?family=).
RABBITMQ_FAMILIES = {
    "queue_coarse_metrics": [
        "queue_messages_ready",
        "queue_messages_unacked",
        "queue_messages",
        "queue_process_reductions_total",
    ],
    "queue_consumer_count": ["queue_consumers"],
    "connection_churn_metrics": [
        "connections_opened_total",
        "connections_closed_total",
        "channels_opened_total",
        "channels_closed_total",
        "queues_declared_total",
        "queues_created_total",
        "queues_deleted_total",
    ],
    "channel_exchange_metrics": [
        "channel_messages_published_total",
        "channel_messages_confirmed_total",
        "channel_messages_unroutable_returned_total",
        "channel_messages_unroutable_dropped_total",
    ],
    "channel_queue_metrics": [
        "channel_get_ack_total",
        "channel_get_total",
        "channel_messages_delivered_ack_total",
        "channel_messages_delivered_total",
        "channel_messages_redelivered_total",
        "channel_messages_acked_total",
        "channel_get_empty_total",
    ],
    "node_coarse_metrics": [
        "process_open_fds",
        "process_open_tcp_sockets",
        "process_resident_memory_bytes",
        "disk_space_available_bytes",
        "erlang_processes_used",
        "erlang_gc_runs_total",
    ],
}
RABBITMQ_TOTALS = ["connections", "channels", "consumers", "queues"]  # /metrics only
# Prometheus' own series for every target.
PROMETHEUS_SYNTHETIC = {
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
}


def rabbitmq_names(prometheus) -> set[str]:
    names: set[str] = set()
    for job in prometheus["scrape_configs"]:
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        if not any(t.endswith(":15692") for t in targets):
            continue
        path = job.get("metrics_path", "/metrics")
        if path == "/metrics":
            names |= {f"rabbitmq_{n}" for fam in RABBITMQ_FAMILIES.values() for n in fam}
            names |= {f"rabbitmq_{n}" for n in RABBITMQ_TOTALS}
        elif path == "/metrics/detailed":
            for family in job["params"]["family"]:
                names |= {f"rabbitmq_detailed_{n}" for n in RABBITMQ_FAMILIES[family]}
    return names


def worker_names() -> set[str]:
    """Every series name a worker's /metrics can hold (a started EngineMetrics
    registry, by the type of each metric family)."""
    from jaxserve.metrics import EngineMetrics

    suffixes = {
        "counter": ["_total", "_created"],
        "histogram": ["_bucket", "_count", "_sum", "_created"],
        "gauge": [""],
    }
    names = set()
    for family in EngineMetrics("m").registry.collect():
        names |= {family.name + s for s in suffixes[family.type]}
    assert "jaxserve_generation_tokens_total" in names and "jaxserve_kv_cache_usage_perc" in names
    return names


def promql_expressions() -> list[tuple[str, str]]:
    out = []
    dashboard = json.loads((OPS / "grafana" / "jaxserve-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"dashboard panel {panel['title']!r}", target["expr"]))
    alerts = yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            out.append((f"alert {rule.get('alert') or rule.get('record')}", rule["expr"]))
    assert len(out) > 10
    return out


def selected_metrics(expr: str) -> set[str]:
    import promql_parser

    # Grafana's interval variables are not PromQL.
    for var in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace(var, "5m")
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name
            if not name:
                matchers = node.matchers.matchers if node.matchers else []
                name = next((m.value for m in matchers if m.name == "__name__"), None)
            assert name, f"a selector without a metric name in {expr!r}"
            names.add(name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_every_promql_expression_names_exported_series(prometheus):
    allowed = worker_names() | rabbitmq_names(prometheus) | PROMETHEUS_SYNTHETIC
    used: set[str] = set()
    for where, expr in promql_expressions():
        names = selected_metrics(expr)
        assert names, (where, expr)
        unknown = names - allowed
        assert not unknown, (
            f"{where}: {sorted(unknown)} is not exported by a worker or by RabbitMQ under ops/prometheus/prometheus.yml ({expr})"
        )
        used |= names
    # the per-queue panels and alerts really read the detailed endpoint
    assert {"rabbitmq_detailed_queue_messages_ready", "rabbitmq_detailed_queue_messages"} <= used
    # a selector check that can fail
    assert selected_metrics("sum(rate(jaxserve_nope_total[5m]))") - allowed == {"jaxserve_nope_total"}
    assert "rabbitmq_detailed_queue_messages_ready" not in rabbitmq_names(
        {"scrape_configs": [{"job_name": "r", "static_configs": [{"targets": ["rabbitmq:15692"]}]}]}
    )


def _selectors_and_groupings(expr: str) -> tuple[list[dict[str, tuple[str, str]]], list[list[str]]]:
    """Every selector's matchers (label -> (op, value)) and every aggregation's
    ``by`` labels in a PromQL expression."""
    import promql_parser

    selectors: list[dict[str, tuple[str, str]]] = []
    groupings: list[list[str]] = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            ms = node.matchers.matchers if node.matchers else []
            selectors.append({m.name: (str(m.op).rsplit(".", 1)[-1], m.value) for m in ms})
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            groupings.append(list(node.modifier.labels))
        return True

    promql_parser.walk(promql_parser.parse(expr.replace("$__rate_interval", "5m")), visit)
    return selectors, groupings


def test_ttft_panels_and_alerts_never_mix_queue_classes():
    """Batch jobs wait behind interactive ones by design: a TTFT quantile
    over both classes rises with the batch backlog, so every TTFT panel and
    alert either selects one class or keeps ``queue`` apart."""
    ttft = [(w, e) for w, e in promql_expressions() if "jaxserve_time_to_first_token_seconds" in e]
    assert len(ttft) >= 3
    for where, expr in ttft:
        selectors, groupings = _selectors_and_groupings(expr)
        one_class = all(sel.get("queue", ("", ""))[0] == "Equal" for sel in selectors)
        split = bool(groupings) and all("queue" in g for g in groupings)
        assert one_class or split, f"{where} mixes interactive and batch TTFT: {expr}"
    (slow,) = [e for w, e in ttft if w == "alert JaxserveInteractiveSlow"]
    assert _selectors_and_groupings(slow)[0][0]["queue"] == ("Equal", "interactive")


def test_job_error_alert_ignores_refusals_and_cancellations():
    import re

    from jaxserve.wire.errors import ERROR_CODES

    (expr,) = [e for w, e in promql_expressions() if w == "alert JaxserveJobErrors"]
    ((op, pattern),) = [sel["outcome"] for sel in _selectors_and_groupings(expr)[0]]
    assert op == "NotRe"
    excluded = {o for o in ("ok", "replayed", *ERROR_CODES) if re.fullmatch(pattern, o)}
    assert excluded == {"ok", "replayed", "overloaded", "rate_limited", "cancelled"}
    # overload still has an alert of its own
    assert any(w == "alert JaxserveOverloaded" and 'code="overloaded"' in e for w, e in promql_expressions())


def test_dashboard_panels_use_the_provisioned_datasource():
    ds = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    (prom,) = [d for d in ds if d["type"] == "prometheus"]
    assert prom["url"] == "http://prometheus:9090"
    dashboard = json.loads((OPS / "grafana" / "jaxserve-dashboard.json").read_text())
    assert dashboard["uid"] == "jaxserve"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": prom["uid"]}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == prom["uid"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not on PATH")
def test_promtool_checks_rules_and_config():
    rules = subprocess.run(
        ["promtool", "check", "rules", str(OPS / "prometheus" / "alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = subprocess.run(
        ["promtool", "check", "config", "prometheus.yml"],
        cwd=OPS / "prometheus",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert config.returncode == 0, config.stdout + config.stderr


# -------------------------------------------------------------- kubernetes
def k8s_docs() -> list[tuple[str, dict]]:
    docs = [(p.name, d) for p in sorted((OPS / "k8s").glob("*.yaml")) for d in yaml_docs(p)]
    assert docs
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in k8s_docs() if d["kind"] == kind]


def strict_schema(schema: Any) -> Any:
    """A CRD's structural schema with unknown fields refused (the API server
    would prune them silently: a misspelt field must fail here)."""
    if isinstance(schema, dict):
        out = {k: strict_schema(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    return schema


def crd_validator(kind: str, version: str) -> jsonschema.Validator:
    for path in DATA.glob("keda.sh_*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
            schema = strict_schema(v["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
            return jsonschema.Draft202012Validator(schema)
    raise AssertionError(f"no vendored CRD for {kind}")


def test_every_manifest_validates():
    import kubernetes_validate

    k8s_version = kubernetes_validate.latest_version()
    kinds = set()
    for _name, doc in k8s_docs():
        kinds.add(doc["kind"])
        group, _, version = doc["apiVersion"].rpartition("/")
        if group == "keda.sh":
            crd_validator(doc["kind"], version).validate(doc)
        else:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
    assert kinds == {"Deployment", "Secret", "ScaledObject", "TriggerAuthentication", "Service", "StatefulSet"}
    # the validators refuse what they should
    (deployment,) = by_kind("Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["prot"] = 9400
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, k8s_version, strict=True)
    (scaled,) = by_kind("ScaledObject")
    broken = json.loads(json.dumps(scaled))
    broken["spec"]["triggers"][0]["metdata"] = broken["spec"]["triggers"][0].pop("metadata")
    with pytest.raises(jsonschema.ValidationError):
        crd_validator("ScaledObject", "v1alpha1").validate(broken)


def worker_container() -> dict:
    (deployment,) = by_kind("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_worker_deployment_pins_the_image_serves_metrics_and_probes():
    (deployment,) = by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = worker_container()
    repo, _, tag = c["image"].rpartition(":")
    assert repo and tag == VERSION, c["image"]  # pinned to the release, never :latest
    args = c["args"]
    assert args[0] == "worker"  # the image's entrypoint is jaxserve
    port = int(flag(args, "--metrics-port"))
    (metrics_port,) = [p for p in c["ports"] if p["name"] == "metrics"]
    assert metrics_port["containerPort"] == port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port) and annotations["prometheus.io/path"] == "/metrics"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    startup = c["startupProbe"]
    assert startup["httpGet"]["port"] == "metrics"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model load and compile
    drain = float(flag(args, "--drain-timeout"))
    assert pod["terminationGracePeriodSeconds"] > drain + 10
    assert flag(args, "--store") == "redis"
    env = {e["name"]: e for e in c["env"]}
    assert env["JAXSERVE_REDIS_URL"]["value"].startswith("redis://")
    ref = env["JAXSERVE_AMQP_URL"]["valueFrom"]["secretKeyRef"]
    (secret,) = by_kind("Secret")
    assert secret["metadata"]["name"] == ref["name"] and ref["key"] in secret["stringData"]
    assert secret["stringData"][ref["key"]].startswith("amqp://")


def test_the_redis_the_worker_names_is_deployed_with_a_persistent_volume():
    """--store=redis against a host nobody runs leaves every job waiting: the
    URL's host must be a Service whose selector picks a Redis pod on its port,
    and that Redis keeps its keys across restarts."""
    from urllib.parse import urlsplit

    url = urlsplit({e["name"]: e for e in worker_container()["env"]}["JAXSERVE_REDIS_URL"]["value"])
    (service,) = [s for s in by_kind("Service") if s["metadata"]["name"] == url.hostname]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == (url.port or 6379)]
    pods = [
        w
        for kind in ("StatefulSet", "Deployment")
        for w in by_kind(kind)
        if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]
    (redis,) = pods
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("redis:")
    assert port["targetPort"] in {p.get("name") for p in container["ports"]} | {
        p["containerPort"] for p in container["ports"]
    }
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    data_dir = args[args.index("--dir") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == data_dir]
    assert mount["name"] in {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}


def test_keda_scales_the_worker_on_both_job_queues():
    from jaxserve.wire.topology import Topology

    topo = Topology()
    (deployment,) = by_kind("Deployment")
    scaled = by_kind("ScaledObject")
    targets = [
        (s["spec"]["scaleTargetRef"].get("kind", "Deployment"), s["spec"]["scaleTargetRef"]["name"]) for s in scaled
    ]
    # KEDA's webhook refuses a second ScaledObject on the same workload
    assert len(targets) == len(set(targets))
    (so,) = scaled
    assert so["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] >= 1 and so["spec"]["maxReplicaCount"] > so["spec"]["minReplicaCount"]
    auths = {a["metadata"]["name"]: a for a in by_kind("TriggerAuthentication")}
    (secret,) = by_kind("Secret")
    queues = {}
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "rabbitmq"
        meta = trigger["metadata"]
        assert meta["mode"] == "QueueLength" and float(meta["value"]) > 0
        assert meta["protocol"] == "amqp" and "host" not in meta  # the URL comes from the secret
        auth = auths[trigger["authenticationRef"]["name"]]
        (ref,) = auth["spec"]["secretTargetRef"]
        assert (
            ref["parameter"] == "host"
            and ref["name"] == secret["metadata"]["name"]
            and ref["key"] in secret["stringData"]
        )
        queues[meta["queueName"]] = float(meta["value"])
    assert set(queues) == {topo.batch, topo.interactive}
    assert queues[topo.interactive] < queues[topo.batch]  # interactive reacts to a shorter backlog


def test_the_probe_paths_are_what_the_metrics_server_answers():
    """The Deployment's probes against jaxserve.metrics' HTTP server: 503 on
    /readyz until the worker says it consumes, 503 on /healthz when its
    liveness check fails, and Prometheus' exposition on /metrics."""
    from jaxserve.metrics import EngineMetrics, serve

    c = worker_container()
    ready_path = c["readinessProbe"]["httpGet"]["path"]
    live_path = c["livenessProbe"]["httpGet"]["path"]
    metrics = EngineMetrics("tiny")
    server = serve(metrics, 0, "127.0.0.1")
    port = server.server_address[1]

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        assert get(ready_path)[0] == 503  # nothing registered: not ready
        assert get(live_path)[0] == 200
        state = {"consuming": False, "engine_ok": True}
        metrics.set_health_checks(
            ready=lambda: (state["consuming"], "consuming" if state["consuming"] else "warming up"),
            live=lambda: (state["engine_ok"], "ok" if state["engine_ok"] else "engine busy in one step for 301s"),
        )
        assert get(ready_path) == (503, "warming up\n")
        state["consuming"] = True
        assert get(ready_path) == (200, "consuming\n")
        assert get(live_path) == (200, "ok\n")
        state["engine_ok"] = False
        assert get(live_path) == (503, "engine busy in one step for 301s\n")
        metrics.job("batch", "ok")
        status, text = get("/metrics")
        assert status == 200 and 'jaxserve_jobs_total{model_name="tiny",outcome="ok",queue="batch"} 1.0' in text
    finally:
        server.shutdown()
        server.server_close()
