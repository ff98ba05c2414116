"""A private RabbitMQ node and a private Redis for the fault suite.

The suite injects faults into brokers (``stop_app``, killed Redis), so it
must never use the shared RabbitMQ (127.0.0.1:5672) or Redis (6379) that
other people's tests run against. Both services here run from a temporary
directory on free ports and are torn down by :meth:`stop`:

* RabbitMQ: ``rabbitmq-server -detached`` with its own node name, ports,
  Mnesia/log directories, an empty plugin list (no management listener),
  its own config files, its own ``rabbitmq-env.conf`` (so the system one,
  which names the shared node, is not read) and its own Erlang cookie
  (``HOME`` points at the temporary directory; the Debian wrapper, which
  switches to the ``rabbitmq`` user and its cookie, is bypassed when the
  real scripts are found under ``/usr/lib/rabbitmq/bin``).
* Redis: ``redis-server --daemonize yes`` with no persistence.

A run that died without tearing down leaves its directory behind;
:func:`cleanup_stale` stops what such a directory's pid files name (only
when the process's command line names that directory) and removes it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

TMP_BASE = Path(os.environ.get("TMPDIR", "/tmp"))
DIR_PREFIX = "jaxserve-faults-"
SHARED_AMQP_PORT = 5672
SHARED_REDIS_PORT = 6379


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(lo: int = 20000, hi: int = 29999, avoid: tuple[int, ...] = ()) -> int:
    """A free TCP port on 127.0.0.1 in [lo, hi] (random, not the shared ones)."""
    for _ in range(500):
        p = lo + secrets.randbelow(hi - lo + 1)
        if p in avoid or p in (SHARED_AMQP_PORT, SHARED_REDIS_PORT):
            continue
        if port_is_free(p):
            return p
    raise RuntimeError(f"no free port in {lo}-{hi}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def cleanup_stale(base: Path = TMP_BASE) -> list[str]:
    """Stop services left behind by earlier suite runs whose owner process is
    gone, and remove their directories. Returns what it did."""
    done = []
    for d in sorted(base.glob(DIR_PREFIX + "*")):
        owner = _read_pid(d / "owner.pid")
        if owner is not None and _pid_alive(owner):
            continue  # a suite that is running now
        children = (d / "children.pids").read_text().split() if (d / "children.pids").exists() else []
        for raw in children:
            pid = int(raw) if raw.isdigit() else None
            cmd = _cmdline(pid) if pid else ""
            if pid and _pid_alive(pid) and "jaxserve" in cmd and "faults-" in cmd:
                os.kill(pid, signal.SIGKILL)
                done.append(f"killed stale jaxserve process {pid} ({d})")
        # redis-server rewrites its command line to "redis-server 127.0.0.1:PORT"
        redis_port = _read_pid(d / "redis" / "redis.port")
        checks = ((d / "rabbit" / "rabbit.pid", str(d)), (d / "redis" / "redis.pid", f"127.0.0.1:{redis_port}"))
        for pidfile, needle in checks:
            pid = _read_pid(pidfile)
            if pid is not None and _pid_alive(pid) and needle in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
                done.append(f"killed stale {pidfile.parent.name} pid {pid} ({d})")
        shutil.rmtree(d, ignore_errors=True)
        done.append(f"removed {d}")
    return done


def make_run_dir(base: Path = TMP_BASE) -> Path:
    d = Path(os.path.realpath(base)) / f"{DIR_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    d.mkdir(parents=True)
    (d / "owner.pid").write_text(str(os.getpid()))
    return d


def _rabbit_script(name: str) -> str:
    """The real RabbitMQ script (not the Debian wrapper that runs it as the
    ``rabbitmq`` user with that user's cookie)."""
    for d in ("/usr/lib/rabbitmq/bin", "/usr/lib/rabbitmq/sbin"):
        p = Path(d) / name
        if p.exists():
            return str(p)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found (is RabbitMQ installed?)")
    return found


class RabbitControl:
    """``rabbitmqctl`` operations on one node (subclasses define ``ctl``)."""

    node: str
    url: str
    port: int

    def ctl(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        raise NotImplementedError

    def stop_app(self) -> None:
        self.ctl("stop_app", timeout=120)

    def start_app(self) -> None:
        self.ctl("start_app", timeout=120)
        self.ctl("await_startup", "--timeout", "60", timeout=90)

    def trace_on(self) -> None:
        self.ctl("trace_on", timeout=60)

    def trace_off(self) -> None:
        self.ctl("trace_off", timeout=60, check=False)

    def list_queues(self, *cols: str) -> list[list[str]]:
        out = self.ctl("-q", "list_queues", "--no-table-headers", *cols, timeout=60)
        rows = []
        for line in out.splitlines():
            parts = line.split("\t") if "\t" in line else line.split()
            if parts and parts[0]:
                rows.append(parts)
        return rows

    def queue_counts(self, prefix: str) -> dict[str, tuple[int, int]]:
        """name -> (ready, unacked) for the queues of ``prefix``."""
        out: dict[str, tuple[int, int]] = {}
        for row in self.list_queues("name", "messages_ready", "messages_unacknowledged"):
            if len(row) >= 3 and row[0].startswith(prefix + "."):
                try:
                    out[row[0]] = (int(row[1]), int(row[2]))
                except ValueError:
                    pass
        return out


class ExternalRabbit(RabbitControl):
    """A broker the user owns (``--amqp-url ... --i-own-the-broker``):
    controlled with the ``rabbitmqctl`` on PATH, never started or stopped."""

    def __init__(self, url: str, node: str) -> None:
        from urllib.parse import urlparse

        self.url = url
        self.node = node
        self.port = urlparse(url).port or 5672

    def ctl(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        cmd = ["rabbitmqctl", "-n", self.node, *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-800:]}")
        return p.stdout

    def stop(self) -> None:
        pass


class PrivateRabbit(RabbitControl):
    """One RabbitMQ node of our own."""

    def __init__(self, root: Path, node_name: str | None = None) -> None:
        self.root = root / "rabbit"
        self.root.mkdir(parents=True, exist_ok=True)
        self.node = node_name or f"jsfaults{os.getpid()}@localhost"
        self.port = free_port()
        # The CLI tools pick their own distribution port in dist+10000..+10010.
        for _ in range(200):
            dist = free_port(avoid=(self.port,))
            if dist + 10010 < 65535 and all(port_is_free(dist + 10000 + i) for i in range(3)):
                break
        else:
            raise RuntimeError("no free distribution port")
        self.dist_port = dist
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"
        self.pid: int | None = None
        self.pidfile = self.root / "rabbit.pid"
        self._write_files()

    def _write_files(self) -> None:
        r = self.root
        (r / "enabled_plugins").write_text("[].\n")
        (r / "rabbitmq.conf").write_text(
            "\n".join(
                [
                    f"listeners.tcp.default = 127.0.0.1:{self.port}",
                    "loopback_users.guest = true",
                    "log.console = false",
                    "log.file.level = info",
                    "vm_memory_high_watermark.relative = 0.4",
                    "disk_free_limit.absolute = 200MB",
                    "",
                ]
            )
        )
        (r / "advanced.config").write_text("[].\n")
        (r / "rabbitmq-env.conf").write_text("# the fault suite's own (the system one names the shared node)\n")
        cookie = r / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)

    def env(self) -> dict[str, str]:
        r = self.root
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_") and k != "ERL_FLAGS"}
        env.update(
            HOME=str(r),
            RABBITMQ_CONF_ENV_FILE=str(r / "rabbitmq-env.conf"),
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(r / "mnesia"),
            RABBITMQ_LOG_BASE=str(r / "log"),
            RABBITMQ_PID_FILE=str(self.pidfile),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(r / "enabled_plugins"),
            RABBITMQ_PLUGINS_EXPAND_DIR=str(r / "plugins-expand"),
            RABBITMQ_CONFIG_FILE=str(r / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(r / "advanced.config"),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    def ctl(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        """``rabbitmqctl -n <our node> ARGS`` (never the shared node)."""
        cmd = [_rabbit_script("rabbitmqctl"), "-n", self.node, *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(), cwd=self.root)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[1:])} failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-800:]}")
        return p.stdout

    def start(self, timeout: float = 180.0) -> float:
        """Start the node and wait until it accepts AMQP connections. Returns seconds."""
        t0 = time.monotonic()
        subprocess.run(
            [_rabbit_script("rabbitmq-server"), "-detached"],
            env=self.env(),
            cwd=self.root,
            check=True,
            timeout=60,
            stdout=open(self.root / "server.out", "ab"),
            stderr=subprocess.STDOUT,
        )
        last = ""
        while time.monotonic() - t0 < timeout:
            time.sleep(1.0)
            pid = _read_pid(self.pidfile)
            if pid is not None:
                self.pid = pid
            try:
                self.ctl("await_startup", "--timeout", "10", timeout=30)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                last = str(exc)
                continue
            if self._amqp_ok():
                self.pid = _read_pid(self.pidfile) or self.pid
                return time.monotonic() - t0
        raise RuntimeError(
            f"private RabbitMQ node {self.node} did not start within {timeout}s: {last}\n{self.log_tail()}"
        )

    def _amqp_ok(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(b"AMQP\x00\x00\x09\x01")
                return len(s.recv(8)) > 0
        except OSError:
            return False

    def log_tail(self, n: int = 30) -> str:
        logs = sorted((self.root / "log").glob("*.log"))
        out = []
        for f in logs[:1]:
            try:
                out += f.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                pass
        return "\n".join(out)

    def stop(self) -> None:
        try:
            self.ctl("stop", timeout=90, check=False)
        except subprocess.TimeoutExpired:
            pass
        pid = self.pid or _read_pid(self.pidfile)
        if pid is not None:
            for _ in range(50):
                if not _pid_alive(pid):
                    break
                time.sleep(0.2)
            if _pid_alive(pid) and str(self.root) in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)


class PrivateRedis:
    """One redis-server of our own; :meth:`shutdown` and :meth:`start` again
    on the same port make an outage."""

    def __init__(self, root: Path) -> None:
        self.root = root / "redis"
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port(30000, 39999)
        self.pidfile = self.root / "redis.pid"
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.pid: int | None = None
        (self.root / "redis.port").write_text(str(self.port))

    def start(self, timeout: float = 30.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found")
        self.pidfile.unlink(missing_ok=True)
        subprocess.run(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "yes",
                "--pidfile",
                str(self.pidfile),
                "--logfile",
                str(self.root / "redis.log"),
                "--dir",
                str(self.root),
            ],
            check=True,
            timeout=30,
            capture_output=True,
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.ping():
                self.pid = _read_pid(self.pidfile)
                return
            time.sleep(0.1)
        raise RuntimeError(f"private redis on {self.port} did not start")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _owned_pid(self) -> int | None:
        pid = self.pid or _read_pid(self.pidfile)
        if pid is not None and _pid_alive(pid) and f"127.0.0.1:{self.port}" in _cmdline(pid):
            return pid
        return None

    def shutdown(self) -> None:
        """Stop it (no save); SIGKILL if it does not go within 5 s."""
        pid = self._owned_pid()
        try:
            subprocess.run(
                [shutil.which("redis-cli") or "redis-cli", "-p", str(self.port), "shutdown", "nosave"],
                capture_output=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass
        t0 = time.monotonic()
        while pid is not None and _pid_alive(pid) and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        pid = self._owned_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        self.pid = None

    def pause(self) -> None:
        pid = self._owned_pid()
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        pid = self._owned_pid()
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.shutdown()
