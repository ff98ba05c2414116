"""Common mistakes end in one line on stderr and a non-zero exit, never a
traceback: no broker at --amqp-url, a model that does not exist, a metrics
port that is taken. The commands run as subprocesses, as a user runs them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest

REPO = Path(__file__).resolve().parents[1]
AMQP_URL = os.environ.get("JAXSERVE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD_AMQP = f"amqp://guest:secret-pw@127.0.0.1:{closed_port()}/"


def jaxserve(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "JAXSERVE_STATE_DIR": str(tmp_path / "state"),
    }
    env.pop("JAXSERVE_AMQP_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "jaxserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tmp_path,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    return proc.stderr


# ------------------------------------------------------------------ broker
@pytest.mark.parametrize(
    "args",
    [
        ("worker", "--prefix", "ops-noop"),
        ("submit", "--prefix", "ops-noop", "hello"),
        ("status", "--prefix", "ops-noop"),
        ("dead", "list", "--prefix", "ops-noop"),
    ],
    ids=lambda a: a[0] if a[0] != "dead" else "dead-list",
)
def test_broker_not_reachable(tmp_path, args):
    proc = jaxserve(tmp_path, *args, "--amqp-url", BAD_AMQP)
    err = assert_one_line_error(proc, "cannot reach RabbitMQ", "127.0.0.1")
    assert proc.returncode == 1
    assert "secret-pw" not in err  # the password is not echoed


def test_broker_refuses_the_login(tmp_path):
    url = AMQP_URL.replace("guest:guest@", "guest:not-the-password@")
    assert url != AMQP_URL
    proc = jaxserve(tmp_path, "status", "--prefix", "ops-noop", "--amqp-url", url)
    assert_one_line_error(proc, "refused the login")


def test_worker_json_logs_report_the_error_as_one_json_line(tmp_path):
    proc = jaxserve(tmp_path, "worker", "--prefix", "ops-noop", "--log-format", "json", "--amqp-url", BAD_AMQP)
    err = assert_one_line_error(proc)
    record = json.loads(err)
    assert record["event"] == "worker_failed" and record["level"] == "error"
    assert "cannot reach RabbitMQ" in record["error"]


def test_shared_helper_for_other_commands(tmp_path):
    """``broker_errors`` is what ``batch`` (and any new command) wraps its
    asyncio.run in: aiormq's own traceback-carrying log record is muted and
    the exception is one line."""
    script = (
        "import asyncio, logging, aio_pika\n"
        "from jaxserve.cli.errors import broker_errors\n"
        "import click\n"
        "@click.command()\n"
        "def main():\n"
        f"    with broker_errors({BAD_AMQP!r}):\n"
        f"        asyncio.run(aio_pika.connect_robust({BAD_AMQP!r}))\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert_one_line_error(proc, "cannot reach RabbitMQ")


# ------------------------------------------------------------------ models
def test_generate_with_a_model_folder_that_does_not_exist(tmp_path):
    proc = jaxserve(tmp_path, "generate", "--model", str(tmp_path / "no-such-model"), "hi")
    assert_one_line_error(proc, "no-such-model", "does not exist")


def test_generate_with_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = jaxserve(tmp_path, "generate", "--model", str(tmp_path / "empty"), "hi")
    assert_one_line_error(proc, "config.json")


def test_worker_with_a_model_folder_that_does_not_exist(tmp_path):
    proc = jaxserve(
        tmp_path, "worker", "--prefix", "ops-noop", "--amqp-url", AMQP_URL, "--model", str(tmp_path / "no-such-model")
    )
    assert_one_line_error(proc, "cannot load the model", "no-such-model")


def test_worker_with_an_unknown_preset_name(tmp_path):
    proc = jaxserve(tmp_path, "worker", "--prefix", "ops-noop", "--amqp-url", AMQP_URL, "--model", "no-such-preset")
    assert_one_line_error(proc, "unknown model 'no-such-preset'", "tiny")


# ------------------------------------------------------------ metrics port
@pytest.mark.parametrize(
    "arg, needles",
    [
        ("foo=1", ["--engine-arg foo: not a setting of the engine; accepted:", "max_num_seqs", "attention_backend"]),
        ("max_num_seqs=abc", ["--engine-arg max_num_seqs='abc': expected an integer"]),
        ("attention_backend=bogus", ["attention_backend='bogus': expected one of auto, reference, pallas, cpu"]),
    ],
)
def test_worker_with_a_bad_engine_arg_is_one_line_naming_it(tmp_path, arg, needles):
    proc = jaxserve(tmp_path, "worker", "--amqp-url", AMQP_URL, "--prefix", "jaxserve-cli-test", "--engine-arg", arg)
    err = assert_one_line_error(proc, *needles)
    assert err.startswith("Error: ") and len(err.strip().splitlines()) == 1, err


def test_worker_metrics_port_in_use(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = jaxserve(tmp_path, "worker", "--prefix", "ops-noop", "--amqp-url", AMQP_URL, "--metrics-port", str(port))
    assert_one_line_error(proc, f"--metrics-port {port} is already in use")


def test_metrics_server_port_taken_later_is_translated_too():
    """The port can be taken between the early check and the metrics server
    start (after the engine build): serve() raises MetricsPortInUse and the
    worker's error handler turns it into the same one-liner."""
    from jaxserve.cli.errors import worker_errors
    from jaxserve.metrics import EngineMetrics, MetricsPortInUse, serve

    metrics = EngineMetrics("m")
    first = serve(metrics, 0, "127.0.0.1")
    port = first.server_address[1]
    try:
        with pytest.raises(MetricsPortInUse):
            serve(metrics, port, "127.0.0.1")
        with pytest.raises(click.ClickException) as info:
            with worker_errors(AMQP_URL):
                serve(metrics, port, "127.0.0.1")
        assert f"metrics port {port} is already in use" in info.value.format_message()
    finally:
        first.shutdown()
        first.server_close()


# ------------------------------------------------------------ producer side
def test_batch_on_a_prefix_with_no_queues(tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"prompt": "hello"}\n')
    proc = jaxserve(
        tmp_path,
        "batch",
        "docs.jsonl",
        "-o",
        "out.jsonl",
        "--no-progress",
        "--prefix",
        "ops-noqueues",
        "--amqp-url",
        AMQP_URL,
    )
    assert_one_line_error(proc, "no queue 'ops-noqueues.batch'", "is a worker running")


def test_batch_csv_without_a_template_says_how_to_build_prompts(tmp_path):
    (tmp_path / "docs.csv").write_text("doc_id,text\n1,Liverpool won 2-0.\n2,Rates rose.\n")
    proc = jaxserve(tmp_path, "batch", "docs.csv", "-o", "out.jsonl", "--amqp-url", AMQP_URL)
    assert_one_line_error(proc, "no 'prompt' or 'messages' column", "--template", "{{ text }}")
    assert not (tmp_path / "out.jsonl").exists()  # nothing ran: no file of failed rows


def test_submit_that_gets_no_result_in_time_says_why(tmp_path):
    """Queues declared, nobody consuming: the timeout names the key and
    where to look instead of a bare "Error: "."""
    import asyncio

    import aio_pika

    from jaxserve.wire.topology import Topology, declare_topology, delete_topology

    topo = Topology(prefix="ops-noconsumer")

    async def declare(fn):
        conn = await aio_pika.connect(AMQP_URL)
        try:
            await fn(conn, topo)
        finally:
            await conn.close()

    asyncio.run(declare(declare_topology))
    try:
        proc = jaxserve(
            tmp_path,
            "submit",
            "--prefix",
            topo.prefix,
            "--timeout",
            "1",
            "--key",
            "k-late",
            "hello",
            "--amqp-url",
            AMQP_URL,
        )
    finally:
        asyncio.run(declare(delete_topology))
    assert_one_line_error(proc, "no result for 'k-late' within 1s", "ops-noconsumer", "jaxserve status")


def test_generate_chat_on_a_model_without_a_chat_template(tmp_path):
    import shutil

    from jaxserve.presets import resolve_model

    folder = tmp_path / "no-template"
    shutil.copytree(resolve_model("tiny"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert not (folder / "chat_template.jinja").exists()
    proc = jaxserve(tmp_path, "generate", "--model", str(folder), "--chat", "--max-tokens", "2", "hi")
    err = assert_one_line_error(proc, f"--chat: {folder} has no chat template", "drop --chat")
    assert "chat_template=" not in err  # a keyword of the Python API, not an option of the command


def test_generate_chat_on_a_gguf_file_without_a_chat_template_names_the_file(tmp_path, monkeypatch):
    """The model is read from a folder derived under the cache; the error
    names the file the user gave, not that folder."""
    pytest.importorskip("gguf")
    from test_gguf import hf_weights, spm_vocab, write_llama_gguf

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))  # the derived folder goes there
    vocab = spm_vocab()
    path = write_llama_gguf(tmp_path / "plain.gguf", vocab, hf_weights(len(vocab["tokens"]), seed=1, tied=True))
    proc = jaxserve(tmp_path, "generate", "--model", str(path), "--chat", "--max-tokens", "2", "hi")
    err = assert_one_line_error(proc, f"--chat: {path} has no chat template", "drop --chat")
    assert "chat_template=" not in err and str(tmp_path / "cache") not in err


def test_every_worker_option_says_what_it_is_for():
    from jaxserve.cli.worker_command import worker

    silent = [p.opts[0] for p in worker.params if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert silent == [], f"options without help: {silent}"
    from click.testing import CliRunner

    shown = CliRunner().invoke(worker, ["--help"], terminal_width=200)
    assert shown.exit_code == 0 and "reject-publish" in shown.output and "JAXSERVE_REDIS_URL" in shown.output


def test_each_command_is_imported_only_when_called():
    """``jaxserve.cli.main`` lists every command by name and imports a
    command's module only when it is asked for: resolving ``worker`` loads
    none of the benchmark's, gateway's or planner's modules (the worker's
    process holds less: BENCHMARKS.md, the memory scenario), and every name
    resolves to the command of that name."""
    code = (
        "import json, sys\n"
        "from jaxserve.cli.main import cli\n"
        "assert cli.get_command(None, 'worker').name == 'worker'\n"
        "print(json.dumps([m for m in sys.modules if m.startswith('jaxserve.cli.')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out))
    assert "jaxserve.cli.worker_command" in loaded
    for other in ("bench", "gateway_command", "plan_command", "loadtest_command", "batch_command", "generate"):
        assert f"jaxserve.cli.{other}" not in loaded, other
    from jaxserve.cli.main import COMMANDS, cli

    names = cli.list_commands(click.Context(cli))
    assert names == sorted(COMMANDS) and {"worker", "submit", "batch", "gateway", "plan", "bench"} <= set(names)
    for name in names:
        command = cli.get_command(click.Context(cli), name)
        assert isinstance(command, click.Command) and command.name == name
    assert cli.get_command(click.Context(cli), "nope") is None
