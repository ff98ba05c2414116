"""``jaxserve worker`` and ``jaxserve batch`` subprocesses for the fault suite.

Every process is started from the source tree under test (``src``: its
``jaxserve`` package and ``tests/`` come first on ``PYTHONPATH``, the
working directory is ``src``), logs to its own file, and is stopped by its
PID only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ECHO_ENGINE = "tests.queue_support:make_echo_engine"

# Every child's pid is appended here (set by the suite), so a later run can
# stop what a killed suite left behind (services.cleanup_stale).
PID_REGISTRY: Path | None = None


def _register(pid: int) -> None:
    if PID_REGISTRY is not None:
        with open(PID_REGISTRY, "a") as f:
            f.write(f"{pid}\n")


def jaxserve_cmd() -> list[str]:
    """The venv's ``jaxserve`` script next to this interpreter (else
    ``python -m jaxserve``)."""
    exe = Path(sys.executable).parent / "jaxserve"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "jaxserve"]


def src_env(src: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(src), str(src / "tests")]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Never fall back to the shared broker or Redis through the environment.
    for k in ("JAXSERVE_AMQP_URL", "JAXSERVE_REDIS_URL", "JAXSERVE_PREFIX"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def rss_mib(pid: int | None) -> float | None:
    """VmRSS of ``pid`` and of its child processes (a worker's engine
    process), in MiB (None if ``pid`` is gone)."""
    if pid is None:
        return None
    own = _vmrss_kib(pid)
    if own is None:
        return None
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        children = []
    return round((own + sum(_vmrss_kib(c) or 0 for c in children)) / 1024.0, 1)


def _vmrss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


_HELP_CACHE: dict[str, str] = {}


def worker_help(src: Path) -> str:
    key = str(src)
    if key not in _HELP_CACHE:
        try:
            p = subprocess.run(
                [*jaxserve_cmd(), "worker", "--help"],
                capture_output=True,
                text=True,
                timeout=120,
                env=src_env(src),
                cwd=src,
            )
            _HELP_CACHE[key] = p.stdout + p.stderr
        except (OSError, subprocess.SubprocessError) as exc:
            _HELP_CACHE[key] = f"(worker --help failed: {exc})"
    return _HELP_CACHE[key]


def worker_has_option(src: Path, option: str) -> bool:
    return option in worker_help(src)


class WorkerDied(RuntimeError):
    pass


class WorkerProc:
    """One ``jaxserve worker`` process."""

    def __init__(
        self, src: Path, log_path: Path, amqp_url: str, prefix: str, args: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.src = src
        self.log_path = log_path
        self.cmd = [
            *jaxserve_cmd(),
            "worker",
            "--amqp-url",
            amqp_url,
            "--prefix",
            prefix,
            "--log-format",
            "json",
            *args,
        ]
        self.env = src_env(src, env)
        self.proc: subprocess.Popen | None = None
        self.started_mono: float | None = None
        self.consuming_after_s: float | None = None
        self.killed = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> WorkerProc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.src, env=self.env, start_new_session=True
        )
        _register(self.proc.pid)
        self.started_mono = time.monotonic()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 25) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def events(self, name: str) -> list[dict[str, Any]]:
        """The worker's JSON log records with ``event == name``."""
        out = []
        needle = f'"{name}"'
        for line in self.log_text().splitlines():
            if needle not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == name:
                out.append(rec)
        return out

    def count_lines(self, needle: str) -> int:
        return sum(1 for line in self.log_text().splitlines() if needle in line)

    async def wait_consuming(self, timeout: float) -> float:
        """Wait for the ``worker_consuming`` log line; returns seconds since start."""
        assert self.proc is not None and self.started_mono is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "worker_consuming" in self.log_text():
                self.consuming_after_s = round(time.monotonic() - self.started_mono, 2)
                return self.consuming_after_s
            if self.proc.poll() is not None:
                raise WorkerDied(f"worker exited with {self.proc.returncode} before consuming:\n{self.log_tail()}")
            await asyncio.sleep(0.2)
        raise WorkerDied(f"worker not consuming after {timeout:.0f}s:\n{self.log_tail()}")

    def sigkill(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.killed = True
            self.proc.wait(30)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (the worker drains), SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        try:
            self._log.close()
        except Exception:  # noqa: BLE001
            pass
        return self.proc.returncode


async def run_batch(
    src: Path,
    input_path: Path,
    output_path: Path,
    amqp_url: str,
    prefix: str,
    *,
    idle_timeout: float,
    timeout: float,
    log_path: Path,
    procs: list,
) -> dict[str, Any]:
    """Run ``jaxserve batch`` to completion (or ``timeout``); returns its exit
    status, the summary line, wall time. ``procs`` collects the process so a
    cancelled scenario can kill it."""
    cmd = [
        *jaxserve_cmd(),
        "batch",
        str(input_path),
        "-o",
        str(output_path),
        "--amqp-url",
        amqp_url,
        "--prefix",
        prefix,
        "--queue",
        "batch",
        "--idle-timeout",
        str(idle_timeout),
        "--no-progress",
    ]
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=log, stderr=log, cwd=src, env=src_env(src), start_new_session=True
        )
        procs.append(proc)
        _register(proc.pid)
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
            proc.kill()
            await proc.wait()
    text = log_path.read_text(errors="replace")
    summary = None
    for line in text.splitlines():
        if line.startswith("batch summary: "):
            try:
                summary = json.loads(line[len("batch summary: ") :])
            except ValueError:
                pass
    tail = "\n".join(text.splitlines()[-12:])
    return {
        "rc": proc.returncode,
        "timed_out": timed_out,
        "wall_s": round(time.monotonic() - t0, 2),
        "summary": summary,
        "log_tail": tail if (proc.returncode or timed_out) else None,
    }


def read_out(path: Path) -> dict[str, list[dict[str, Any]]]:
    """OUT.jsonl of ``jaxserve batch``: the suite's key (found in
    ``custom_id`` or ``id``, which a batch command may scope) -> result lines."""
    from faults_support.collector import TAG_RE

    out: dict[str, list[dict[str, Any]]] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(rec, dict):
                    continue
                for field in ("custom_id", "id"):
                    m = TAG_RE.search(str(rec.get(field) or ""))
                    if m:
                        out.setdefault(m.group(0), []).append(rec)
                        break
    except OSError:
        pass
    return out
