"""Helpers of the gateway tests: ``jaxserve gateway`` as a subprocess on a
free port, waited for until it answers, and the echo worker's subprocess
arguments. The broker, the workers and Redis are the real ones
(``queue_support``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from queue_support import AMQP_URL, REPO, delete_prefix, free_port, worker_env


class GatewayProcess:
    """One ``jaxserve gateway`` subprocess (JSON logs to ``log``)."""

    def __init__(self, prefix: str, state_dir: Path, log: Path, *extra: str, port: int | None = None) -> None:
        self.prefix = prefix
        self.state_dir = state_dir
        self.log = log
        self.extra = extra
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        cmd = [
            sys.executable,
            "-m",
            "jaxserve.cli.main",
            "gateway",
            "--amqp-url",
            AMQP_URL,
            "--prefix",
            self.prefix,
            "--port",
            str(self.port),
            "--state-dir",
            str(self.state_dir),
            "--log-format",
            "json",
            *self.extra,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=worker_env(), stdout=open(self.log, "ab"), stderr=subprocess.STDOUT
        )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"the gateway exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"the gateway did not answer within {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no drain, no lease given back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())

    def log_events(self) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


def echo_worker_args(*extra: str) -> list[str]:
    """``jaxserve worker`` arguments for the echo engine (a queue double
    with the real engine's interface, ``queue_support.EchoEngine``)."""
    return ["--store", "memory", *extra]


def drop_prefix(prefix: str) -> None:
    asyncio.run(delete_prefix(prefix))


def openai_line(custom_id: str, prompt: str, *, model: str, max_tokens: int = 8, chat: bool = True, **extra) -> str:
    body = {"model": model, "max_tokens": max_tokens, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    url = "/v1/chat/completions" if chat else "/v1/completions"
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
