"""The deployment the ``two-model`` scenario load-tests: two workers on one prefix.

A large model and a small one, each a ``jaxserve worker`` with its own
served name (``--served-model-name``), on one private prefix, so that a job
naming the large model may be re-routed to the small one when the large
worker would answer ``overloaded`` (docs/protocol.md, "Fallbacks and
degraded answers"). Here: the prices file both workers and ``jaxserve plan``
read, the profiles ``jaxserve plan --measure`` writes, starting and waiting
for the workers, whether the worker build routes by model at all, and the
clean-up of every queue and exchange of the prefix (the per-model queues and
the models exchange included, which ``queue_common.delete_topology`` does
not know).

Kept apart from the scenario (``two_model.py``) so that the scenario reads
as the measurement: probe, two runs, plan, figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class ModelSpec:
    """One side of the deployment: the preset it loads, the name jobs use,
    its token prices (USD per million) and its machine's price per hour."""

    preset: str
    served: str
    prompt_per_million: float
    completion_per_million: float
    hardware_per_hour: float

    def token_price(self) -> dict[str, float]:
        return {"prompt_per_million": self.prompt_per_million, "completion_per_million": self.completion_per_million}


def write_prices(path: Path, models: list[ModelSpec], currency: str = "USD") -> Path:
    """A prices file (docs/cost.md) with token prices under both names of
    each model: the served name (what the worker prices its results by) and
    the preset (what a ``plan --measure`` profile calls the model, which is
    the name ``jaxserve plan --prices`` looks up)."""
    entries: dict[str, Any] = {}
    for m in models:
        entries[m.served] = m.token_price()
        entries[m.preset] = m.token_price()
    path.write_text(json.dumps({"currency": currency, "models": entries}, indent=1) + "\n")
    return path


def measure_profile(preset: str, out: Path, log: Path, max_model_len: int, timeout: float = 600) -> dict[str, Any]:
    """``jaxserve plan --measure`` with few sizes (the whole scenario has a
    quarter of an hour): the profile ``jaxserve plan`` needs for the model."""
    import queue_common as qc  # benchmarks/ is on sys.path (suite.py)

    cmd = [
        qc.jaxserve_exe(),
        "plan",
        "--measure",
        "--model",
        preset,
        "--output",
        str(out),
        "--chunks",
        "64,128,256",
        "--batches",
        "1,4,16",
        "--contexts",
        "128",
        "--decode-steps",
        "8",
        "--repeats",
        "1",
        "--measure-max-model-len",
        str(max_model_len),
    ]
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout, check=False)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"plan --measure {preset} exited {proc.returncode}: see {log}")
    return {"profile": str(out), "seconds": round(time.monotonic() - t0, 1), "command": " ".join(cmd[1:])}


class Worker:
    """One ``jaxserve worker`` subprocess; ready when its JSON log says
    ``worker_consuming`` (a named model's queues are not the ones
    ``queue_common.WorkerProc.wait_consuming`` polls)."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.pid = self.proc.pid
        self.started = time.monotonic()

    def wait_consuming(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.tail()}")
            if b'"worker_consuming"' in self.log.read_bytes():
                return round(time.monotonic() - self.started, 1)
            time.sleep(0.5)
        raise RuntimeError(f"worker not consuming after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def events(self, name: str) -> int:
        """How many log lines carry ``"event": name`` (e.g. a re-route)."""
        needle = f'"{name}"'.encode()
        return sum(1 for line in self.log.read_bytes().splitlines() if needle in line)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM by PID (the worker drains), SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        return self.proc.returncode


def worker_help() -> str:
    import queue_common as qc

    return subprocess.run(
        [qc.jaxserve_exe(), "worker", "--help"], capture_output=True, text=True, timeout=120, check=False
    ).stdout


def start_worker(
    prefix: str,
    spec: ModelSpec,
    *,
    log: Path,
    prices: Path | None,
    engine: dict[str, Any],
    extra: list[str],
) -> Worker:
    import queue_common as qc

    cmd = [
        qc.jaxserve_exe(),
        "worker",
        "--model",
        spec.preset,
        "--served-model-name",
        spec.served,
        "--prefix",
        prefix,
        "--amqp-url",
        qc.AMQP_URL,
        "--store",
        "memory",
        "--log-format",
        "json",
    ]
    for k, v in engine.items():
        cmd += ["--engine-arg", f"{k}={v}"]
    if prices is not None:
        cmd += ["--prices", str(prices)]
    return Worker(cmd + extra, log)


def routing_declared(prefix: str) -> bool:
    """Whether ``<prefix>.models`` exists: a worker that routes by model
    declares it (jaxserve/worker/routing.py); one that predates routing does
    not, and then a job naming a model goes to the default queues."""

    async def check() -> bool:
        import aio_pika
        import aiormq.exceptions

        import queue_common as qc

        conn = await aio_pika.connect(qc.AMQP_URL)
        try:
            ch = await conn.channel()
            try:
                await ch.declare_exchange(f"{prefix}.models", passive=True)
                return True
            except aiormq.exceptions.ChannelNotFoundEntity:
                return False
        finally:
            await conn.close()

    return asyncio.run(check())


def delete_all(prefix: str, served: list[str]) -> list[str]:
    """Every queue and exchange of the prefix: the default topology
    (``queue_common.delete_topology``), each served model's job queues and
    the models exchange."""
    import queue_common as qc
    from jaxserve.wire.topology import Topology

    topo = Topology(prefix=prefix)
    model_queues = [topo.model_queue(c, name) for name in served for c in ("interactive", "batch")]
    deleted = qc.delete_topology(prefix, extra_queues=model_queues)

    async def drop_exchange() -> bool:
        import aio_pika

        conn = await aio_pika.connect(qc.AMQP_URL)
        try:
            ch = await conn.channel()
            try:
                await ch.exchange_delete(f"{prefix}.models")
                return True
            except Exception:  # noqa: BLE001 - absent (a build without routing)
                return False
        finally:
            await conn.close()

    if asyncio.run(drop_exchange()):
        deleted.append(f"{prefix}.models")
    return deleted


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
