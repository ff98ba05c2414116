"""The README's main job: ``./dev.sh demo``.

Starts a worker with the default model against the local RabbitMQ, pushes a
batch of documents through ``jaxserve batch`` (with its progress bar), then
streams an interactive answer to the terminal with ``jaxserve submit
--stream``, shows ``jaxserve status``, and stops the worker with SIGTERM
(which drains it). Everything uses the real commands a user would type, under
a ``jaxserve-demo`` prefix so the demo never touches production queues.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

PREFIX = "jaxserve-demo"
DOCUMENTS = [
    "The delivery arrived two days late and the box was crushed.",
    "Fantastic support team, they fixed my account in minutes.",
    "The invoice lists a charge I never agreed to.",
    "Setup was simple and the device works exactly as described.",
    "I waited an hour on hold and nobody answered.",
    "Great value for the price, I would buy it again.",
    "The app crashes every time I open the settings page.",
    "Clear documentation and a friendly community.",
]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxserve", *args]


def _wait_for_consumers(amqp_url: str, worker: subprocess.Popen, timeout: float = 600.0) -> None:
    from jaxserve.client import Client

    deadline = time.monotonic() + timeout
    with Client(amqp_url, prefix=PREFIX) as client:
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                raise SystemExit(f"the worker exited with code {worker.returncode} before it was ready")
            try:
                depths = client.queue_depths()
                if depths.get(f"{PREFIX}.batch", {}).get("consumers", 0) > 0:
                    return
            except Exception:  # noqa: BLE001 - queues not declared yet
                pass
            time.sleep(1.0)
    raise SystemExit("the worker did not start consuming in time")


def main(argv: list[str] | None = None) -> int:
    amqp_url = os.environ.get("JAXSERVE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    env = {**os.environ, "JAXSERVE_AMQP_URL": amqp_url, "JAXSERVE_PREFIX": PREFIX}
    print("jaxserve demo: a worker serves the `tiny` preset, whose random weights make its text noise.\n", flush=True)
    print("1. starting a worker (it compiles every shape bucket before it consumes a job) ...", flush=True)
    worker = subprocess.Popen(
        _cli("worker", "--model", "tiny", "--max-num-seqs", "16", "--log-level", "warning"),
        env=env,
    )
    try:
        started = time.perf_counter()
        _wait_for_consumers(amqp_url, worker)
        print(f"   worker consuming after {time.perf_counter() - started:.1f} s\n", flush=True)

        with tempfile.TemporaryDirectory(prefix="jaxserve-demo-") as tmp:
            src, out = Path(tmp) / "documents.jsonl", Path(tmp) / "results.jsonl"
            with src.open("wb") as f:
                for i in range(48):
                    doc = DOCUMENTS[i % len(DOCUMENTS)]
                    body = {
                        "custom_id": f"doc-{i:03d}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "messages": [{"role": "user", "content": f"Label as positive or negative: {doc}"}],
                            "max_tokens": 8,
                            "temperature": 0,
                        },
                    }
                    f.write(orjson.dumps(body) + b"\n")
            print(f"2. jaxserve batch {src.name} -o {out.name}  (48 documents, OpenAI Batch API lines)", flush=True)
            subprocess.run(_cli("batch", str(src), "-o", str(out)), env=env, check=True)
            first = orjson.loads(out.read_bytes().splitlines()[0])
            print(f"   first result line: {orjson.dumps(first).decode()[:160]}...\n", flush=True)

        print("3. jaxserve submit --queue interactive --stream --chat \"Tell me about queues.\"", flush=True)
        subprocess.run(
            _cli("submit", "--queue", "interactive", "--stream", "--chat", "--max-tokens", "32",
                 "--temperature", "0.8", "--seed", "1", "Tell me about queues."),
            env=env, check=True,
        )
        print("\n4. jaxserve status", flush=True)
        subprocess.run(_cli("status"), env=env, check=True)
    finally:
        if worker.poll() is None:
            print("\n5. SIGTERM to the worker: it stops consuming and drains in-flight work", flush=True)
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
