"""Shared helpers of the queue benchmarks (``benchmarks/queue_*.py``).

- start a ``jaxserve worker`` subprocess on a private prefix and wait until
  it consumes; stop it by PID; delete the prefix's queues and exchanges;
- CPU accounting from ``/proc`` (per process, and per thread for the worker:
  the main thread runs the asyncio loop, the others are the engine thread and
  XLA's pool), so an overhead can be attributed instead of guessed;
- scrape the worker's Prometheus ``/metrics`` (engine steps, tokens);
- read the worker's JSON log (``job_done`` timings);
- describe the machine.

Nothing here changes jaxserve: the benchmarks drive its CLI and client.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
AMQP_URL = os.environ.get("JAXSERVE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def jaxserve_exe() -> str:
    """The venv's ``jaxserve`` script (next to this interpreter)."""
    exe = Path(sys.executable).parent / "jaxserve"
    if not exe.exists():
        raise SystemExit(f"{exe} not found: run with the project's venv python (.venv/bin/python)")
    return str(exe)


def new_prefix(kind: str) -> str:
    return f"bench-{kind}-{uuid.uuid4().hex[:10]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------ machine
def machine_info() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info: dict[str, Any] = {
        "nproc": int(nproc) if nproc.isdigit() else None,
        "cpu_model": model,
        "mem_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
    }
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax_backend"] = jax.default_backend()
    except Exception:  # noqa: BLE001
        pass
    try:
        info["rabbitmq"] = subprocess.run(
            ["rabbitmqctl", "-q", "version"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["rabbitmq"] = None
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "jaxserve"],
            capture_output=True,
            text=True,
        ).stdout.split("\n")
        info["git_head"] = head
        info["jaxserve_uncommitted_files"] = sorted(line[3:] for line in dirty if line.strip())
    except OSError:
        pass
    # The code that ran (the working tree may hold uncommitted changes).
    import hashlib

    h = hashlib.sha256()
    for f in sorted((REPO / "jaxserve").rglob("*.py")):
        h.update(str(f.relative_to(REPO)).encode())
        h.update(f.read_bytes())
    info["jaxserve_tree_sha256"] = h.hexdigest()[:16]
    return info


# ---------------------------------------------------------------------- CPU
def _stat_fields(path: str) -> list[str] | None:
    try:
        raw = Path(path).read_text()
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    rparen = raw.rindex(")")
    return [raw[raw.index("(") + 1 : rparen], *raw[rparen + 2 :].split()]


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads)."""
    f = _stat_fields(f"/proc/{pid}/stat")
    if f is None:
        return None
    # after comm: state(0) ... utime is field 14 overall -> index 12 here (+1 for comm)
    return (int(f[12]) + int(f[13])) / CLK_TCK


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (comm, CPU seconds) for every thread of ``pid``."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        f = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if f is not None:
            out[int(tid)] = (f[0], (int(f[12]) + int(f[13])) / CLK_TCK)
    return out


def find_broker_pid() -> int | None:
    """The RabbitMQ node's Erlang VM (read-only use: CPU accounting)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if Path(f"/proc/{entry}/comm").read_text().strip() == "beam.smp":
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                if b"rabbit" in cmd:
                    return int(entry)
        except OSError:
            continue
    return None


class CpuMeter:
    """CPU seconds spent by the worker (its loop thread vs the rest), the
    broker, and this process's waited-for children, between ``start`` and
    ``stop``."""

    def __init__(self, worker_pid: int | None, broker_pid: int | None) -> None:
        self.worker_pid = worker_pid
        self.broker_pid = broker_pid

    def _snap(self) -> dict[str, Any]:
        import resource

        ru_c = resource.getrusage(resource.RUSAGE_CHILDREN)
        ru_s = resource.getrusage(resource.RUSAGE_SELF)
        snap: dict[str, Any] = {
            "t": time.monotonic(),
            "children": ru_c.ru_utime + ru_c.ru_stime,
            "self": ru_s.ru_utime + ru_s.ru_stime,
        }
        if self.worker_pid is not None:
            snap["worker_threads"] = thread_cpu_s(self.worker_pid)
        if self.broker_pid is not None:
            snap["broker"] = proc_cpu_s(self.broker_pid)
        snap["system"] = _system_cpu_s()
        return snap

    def start(self) -> None:
        self._a = self._snap()

    def stop(self) -> dict[str, float]:
        b = self._snap()
        a = self._a
        wall = b["t"] - a["t"]
        out: dict[str, float] = {
            "wall_s": wall,
            "bench_process_s": b["self"] - a["self"],
            "children_s": b["children"] - a["children"],
        }
        if self.worker_pid is not None:
            wa, wb = a["worker_threads"], b["worker_threads"]
            loop = other = 0.0
            for tid, (_comm, secs) in wb.items():
                d = secs - wa.get(tid, ("", 0.0))[1]
                if tid == self.worker_pid:
                    loop += d
                else:
                    other += d
            out["worker_loop_thread_s"] = loop
            out["worker_other_threads_s"] = other
        if self.broker_pid is not None and a.get("broker") is not None and b.get("broker") is not None:
            out["broker_s"] = b["broker"] - a["broker"]
        if a["system"] and b["system"]:
            busy = b["system"][0] - a["system"][0]
            total = b["system"][1] - a["system"][1]
            out["machine_busy_s"] = busy
            out["machine_busy_frac"] = busy / total if total > 0 else None
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def _system_cpu_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot."""
    try:
        parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    vals = [int(x) for x in parts]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return ((total - idle) / CLK_TCK, total / CLK_TCK)


# ------------------------------------------------------------------ metrics
def scrape_metrics(port: int | None) -> dict[str, float]:
    """Sum of every sample of the worker's /metrics, by metric name."""
    if port is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def worker_supports(flag: str) -> bool:
    try:
        txt = subprocess.run([jaxserve_exe(), "worker", "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return flag in txt


# ------------------------------------------------------------------- worker
class WorkerProc:
    """A ``jaxserve worker`` subprocess on its own prefix."""

    def __init__(
        self,
        prefix: str,
        engine: dict[str, Any],
        extra: list[str],
        log_path: Path,
        metrics: bool = True,
        env: dict[str, str] | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        """``launcher``: the command that stands for ``jaxserve`` (default:
        the installed script)."""
        self.prefix = prefix
        self.log_path = log_path
        self.metrics_port = free_port() if metrics and worker_supports("--metrics-port") else None
        cmd = [
            *(launcher or [jaxserve_exe()]),
            "worker",
            "--model",
            str(engine.get("model", "tiny")),
            "--prefix",
            prefix,
            "--amqp-url",
            AMQP_URL,
            "--log-format",
            "json",
        ]
        for k, v in engine.items():
            if k != "model" and v is not None:
                cmd += ["--engine-arg", f"{k}={v}"]
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port)]
        cmd += extra
        self.cmd = cmd
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})}
        )
        self.pid = self.proc.pid
        self.started = time.monotonic()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_consuming(self, timeout: float = 300.0) -> float:
        """Poll the job queues' consumer counts (passive declares) until the
        worker consumes both; returns the seconds it took."""

        async def consumers() -> tuple[int, int]:
            import aio_pika
            import aiormq.exceptions

            conn = await aio_pika.connect(AMQP_URL)
            try:
                counts = []
                for name in (f"{self.prefix}.interactive", f"{self.prefix}.batch"):
                    ch = await conn.channel()
                    try:
                        q = await ch.declare_queue(name, passive=True)
                        counts.append(q.declaration_result.consumer_count)
                    except aiormq.exceptions.ChannelNotFoundEntity:
                        counts.append(0)
                    finally:
                        if not ch.is_closed:
                            await ch.close()
                return counts[0], counts[1]
            finally:
                await conn.close()

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            if min(asyncio.run(consumers())) >= 1:
                return time.monotonic() - self.started
            time.sleep(0.5)
        raise RuntimeError(f"worker not consuming after {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM by PID (the worker drains), SIGKILL if it lingers."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def job_done_records(self) -> list[dict[str, Any]]:
        """The worker's ``job_done`` log lines (JSON format)."""
        out = []
        try:
            with open(self.log_path, "rb") as f:
                for line in f:
                    if b'"job_done"' not in line:
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("event") == "job_done":
                        out.append(rec)
        except OSError:
            pass
        return out

    def stopped_stats(self) -> dict[str, Any] | None:
        try:
            with open(self.log_path, "rb") as f:
                for line in f:
                    if b'"worker_stopped"' in line:
                        return json.loads(line).get("stats")
        except (OSError, ValueError):
            pass
        return None


def delete_topology(prefix: str, extra_queues: list[str] = ()) -> list[str]:
    """Delete every queue and exchange of ``prefix`` (the job queues, dead
    letters, results, and the given reply queues). Returns what was deleted."""

    async def main() -> list[str]:
        import aio_pika

        deleted = []
        conn = await aio_pika.connect(AMQP_URL)
        try:
            for name in [
                f"{prefix}.interactive",
                f"{prefix}.batch",
                f"{prefix}.dead",
                f"{prefix}.results",
                *extra_queues,
            ]:
                ch = await conn.channel()
                try:
                    await ch.queue_delete(name)
                    deleted.append(name)
                except Exception:  # noqa: BLE001 - already gone
                    pass
                finally:
                    if not ch.is_closed:
                        await ch.close()
            for name in (f"{prefix}.dlx", f"{prefix}.control"):
                ch = await conn.channel()
                try:
                    await ch.exchange_delete(name)
                    deleted.append(name)
                except Exception:  # noqa: BLE001
                    pass
                finally:
                    if not ch.is_closed:
                        await ch.close()
        finally:
            await conn.close()
        return deleted

    return asyncio.run(main())


def leftover_queues(prefix: str) -> list[str]:
    """Queues whose name starts with ``prefix`` (rabbitmqctl; empty if absent)."""
    try:
        out = subprocess.run(
            ["rabbitmqctl", "-q", "list_queues", "name"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip().startswith(prefix)]


def write_results(name: str, data: dict[str, Any]) -> Path:
    """``benchmarks/results/queue-[<name>-]<date>.json`` (UTC date)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    path = RESULTS_DIR / (f"queue-{name}-{date}.json" if name else f"queue-{date}.json")
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def write_stamped(prefix: str, data: dict[str, Any]) -> Path:
    """``benchmarks/results/<prefix>-<UTC date-time>.json`` (one file per run)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{prefix}-{time.strftime('%Y-%m-%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def profiled_worker(profile_path: Path, factory: str = "build_engine") -> tuple[list[str], dict[str, str], list[str]]:
    """``jaxserve worker`` flags, environment and launcher for
    ``queue_profile.py``'s instrumentation, which writes its record to
    ``profile_path`` when the worker exits: the launcher runs the worker's
    command with the event loop's side instrumented, and the flags name one
    of its engine factories, which instruments the engine wherever it runs
    (the worker's engine process by default). benchmarks/ joins the caller's
    ``PYTHONPATH`` so both processes can import it."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")]))
    launcher = [sys.executable, str(Path(__file__).resolve().parent / "queue_profile.py")]
    return (
        ["--engine", f"queue_profile:{factory}"],
        {"PYTHONPATH": path, "QUEUE_PROFILE_OUT": str(profile_path)},
        launcher,
    )
