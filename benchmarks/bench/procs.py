"""Processes the suite starts: their trees, their CPU time, pausing them, and
a peer kept loaded behind ``benchmarks/peers/common.py``'s ``--serve`` protocol.

Pausing: these machines are small and shared, so while one system runs its
timed turn the others are stopped (SIGSTOP to their whole process tree,
SIGCONT after the turn): left running, an idle vLLM engine core polled for up
to 0.6 CPU-seconds of another system's 6-second run.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "@@bench "  # peers/common.py's result lines


def process_table() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Children of every process and each one's user + system CPU seconds (Linux /proc)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    return children, stats


def tree_pids(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``pid`` and its descendants."""
    if children is None:
        children, _ = process_table()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu_seconds(pid: int) -> float:
    children, stats = process_table()
    return sum(stats.get(p, 0.0) for p in tree_pids(pid, children))


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (a worker and its engine process)."""
    total = 0
    for p in tree_pids(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return round(total / 1024.0, 1)


def signal_tree(pid: int, sig: int) -> None:
    for p in tree_pids(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


class Paused:
    """Context: the given process trees stopped for the duration."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def __enter__(self) -> Paused:
        for pid in self.pids:
            signal_tree(pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in self.pids:
            signal_tree(pid, signal.SIGCONT)


class ServePeer:
    """A peer script in ``--serve`` mode: loads once, then one timed run per ``run K``."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.records: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                try:
                    self.records.put(json.loads(line[len(PREFIX) :]))
                except json.JSONDecodeError:
                    pass
        self.records.put({"event": "exit", "returncode": self.proc.wait()})

    def next_record(self, timeout: float) -> dict:
        try:
            return self.records.get(timeout=timeout)
        except queue.Empty:
            return {"event": "timeout", "error": f"no answer within {timeout} s"}

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("quit")
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()  # the process this object started, by its handle
            self.proc.wait()
        self._log.close()
