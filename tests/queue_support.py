"""Test doubles and helpers for the queue tests.

The BROKER is always the real RabbitMQ; only the engine is replaced, by
:class:`EchoEngine`, a deterministic double with the real engine's interface
(see ``jaxserve/worker/engine_thread.py``): its completion is derived from
the prompt (one token per word, ids :func:`piece_token`), a request added
with ``prior`` output (a job continued from its saved tokens) goes on after
it, it schedules interactive before batch within ``max_num_seqs`` and, within
a class, the lower ``priority`` value first (the real scheduler's order); a
prompt containing :data:`FAIL_MARKER` fails that request's step alone (the
real engine's containment); it can be stalled, slowed, or made to burn CPU
(holding the GIL in bursts).

``make_echo_engine`` is importable as ``tests.queue_support:make_echo_engine``
for ``jaxserve worker --engine``; it reads ``JAXSERVE_ECHO_*`` environment
variables and ``--engine-arg key=value`` options.
"""

from __future__ import annotations

import collections
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Any

from jaxserve.engine.types import EngineBroken, PriorOutput, RequestClass, RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.lifecycle import job_key_of


class ByteTokenizer:
    """One token per UTF-8 byte; a toy chat template."""

    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        out = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return out + ("<|assistant|>" if add_generation_prompt else "")


def expected_completion(prompt: str, max_tokens: int, stop: tuple[str, ...] = ()) -> tuple[str, str]:
    """What EchoEngine answers for ``prompt``: (text, finish_reason)."""
    words = prompt.split() or ["x"]
    text = ""
    for i in range(max_tokens):
        text += words[i % len(words)] + " "
        for s in stop:
            j = text.find(s)
            if j >= 0:
                return text[:j], "stop"
    return text, "length"


class _Req:
    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        rc: RequestClass,
        priority: int,
        deadline: float | None,
        tok: ByteTokenizer,
    ) -> None:
        self.id = rid
        self.prompt_text = tok.decode(prompt_ids)
        self.prompt_tokens = len(prompt_ids)
        self.params = params
        self.rc = rc
        self.priority = priority
        self.deadline = deadline
        self.arrival = time.monotonic()
        self.full, self.reason = expected_completion(self.prompt_text, params.max_tokens, tuple(params.stop))
        self.pieces = [p for p in re.findall(r"\S*\s*", self.full) if p]
        self.pos = 0
        self.resumed_text = ""  # the saved pieces' text, carried by the first delta (as the real engine does)
        self.held_first = HELD_FIRST_MARKER in self.prompt_text
        self.label_logprobs: list[float] | None = None
        self.label_tokens = 0


def piece_token(i: int) -> int:
    """EchoEngine's token id of its ``i``-th piece of output (a word and its space)."""
    return 100 + i


# A prompt containing this makes EchoEngine fail that request's step (alone).
FAIL_MARKER = "<<fail-step>>"
# A prompt containing this gets a first token whose text is held back (as a
# real detokenizer holds part of a UTF-8 character), after which the engine
# stalls until the test unstalls it.
HELD_FIRST_MARKER = "<<held-first>>"


class EchoEngine:
    def __init__(
        self,
        *,
        max_num_seqs: int = 8,
        interactive_reserved_seqs: int = 2,
        max_model_len: int = 512,
        step_s: float = 0.002,
        busy_step_s: float = 0.0,
        warmup_s: float = 0.0,
        model_name: str = "echo",
        stalled: bool = False,
        break_after_steps: int = 0,
        fail_every_step: bool = False,
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.max_num_seqs = max_num_seqs
        self.interactive_reserved_seqs = interactive_reserved_seqs
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.step_s = step_s
        self.busy_step_s = busy_step_s
        self.warmup_s = warmup_s
        self.warmed = False
        self.gate = threading.Event()
        if not stalled:
            self.gate.set()
        self.waiting: list[_Req] = []
        self.running: dict[str, _Req] = {}
        self.add_count: collections.Counter = collections.Counter()
        self.priors: dict[str, PriorOutput] = {}  # by job key: the saved output a request was continued from
        self.aborted: list[str] = []
        self.max_running_seen = 0
        self.thread_ids: set[int] = set()
        self.fail_next_step = False
        # Faults of the whole engine: EngineBroken after this many steps (0:
        # never), or an ordinary exception from every step.
        self.break_after_steps = break_after_steps
        self.fail_every_step = fail_every_step
        self.steps = 0

    # switches used by tests (thread-safe: Event)
    def stall(self) -> None:
        self.gate.clear()

    def unstall(self) -> None:
        self.gate.set()

    def warmup(self) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.warmup_s:
            time.sleep(self.warmup_s)
        self.warmed = True

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_class: RequestClass = RequestClass.BATCH,
        priority: int = 0,
        deadline: float | None = None,
        prior: PriorOutput | None = None,
    ) -> None:
        self.thread_ids.add(threading.get_ident())
        if not self.warmed:
            raise RuntimeError("add_request before warmup")
        if request_id in self.running or any(r.id == request_id for r in self.waiting):
            raise RequestError("invalid_request", f"duplicate request id {request_id}")
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError("context_length_exceeded", "too long")
        self.add_count[job_key_of(request_id)] += 1  # counted per job key (the worker adds one id per run)
        req = _Req(request_id, ids, params, RequestClass.parse(request_class), priority, deadline, self.tokenizer)
        if prior is not None:
            # A request continued from saved output: the pieces it names (one
            # token each, ids piece_token(i)) are not generated again.
            self.priors[job_key_of(request_id)] = prior
            if list(prior.token_ids) != [piece_token(i) for i in range(len(prior.token_ids))]:
                raise RequestError("invalid_request", "prior output this request cannot have produced")
            req.pos = min(len(prior.token_ids), len(req.pieces) - 1)
            req.resumed_text = "".join(req.pieces[: req.pos])
        self.waiting.append(req)

    def add_score_request(
        self,
        request_id: str,
        prompt: list[int],
        labels: list[list[int]],
        *,
        request_class: RequestClass = RequestClass.BATCH,
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Label scoring like the real engine's interface: one finished
        output whose ``label_logprobs`` are a deterministic function of the
        prompt and each label (the label sharing most bytes with the prompt
        scores best), costing one step."""
        self.thread_ids.add(threading.get_ident())
        if not labels or any(not ids for ids in labels):
            raise RequestError("invalid_request", "every label needs at least one token")
        if len(prompt) + max(len(ids) for ids in labels) > self.max_model_len:
            raise RequestError("context_length_exceeded", "too long")
        self.add_count[job_key_of(request_id)] += 1
        params = SamplingParams(max_tokens=1, temperature=0.0)
        req = _Req(
            request_id, list(prompt), params, RequestClass.parse(request_class), priority, deadline, self.tokenizer
        )
        seen = set(prompt)
        req.label_logprobs = [-0.1 * len(ids) - 0.5 * sum(1 for t in ids if t not in seen) for ids in labels]
        req.label_tokens = sum(len(ids) for ids in labels)
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        self.thread_ids.add(threading.get_ident())
        self.aborted.append(job_key_of(request_id))
        if self.running.pop(request_id, None) is not None:
            return True
        for i, r in enumerate(self.waiting):
            if r.id == request_id:
                del self.waiting[i]
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if not self.gate.wait(0.05):
            return []
        self.steps += 1
        if self.break_after_steps and self.steps >= self.break_after_steps:
            raise EngineBroken("injected: the device state is gone")
        if self.fail_next_step or self.fail_every_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        outs: list[RequestOutput] = []
        now = time.monotonic()
        # deadlines while waiting
        for r in list(self.waiting):
            if r.deadline is not None and now >= r.deadline:
                self.waiting.remove(r)
                outs.append(
                    RequestOutput(
                        r.id,
                        [],
                        "",
                        finished=True,
                        finish_reason="error",
                        error=RequestError("expired", "deadline passed while waiting"),
                    )
                )
        # admit like the real scheduler's priority policy: interactive first,
        # then the LOWER priority value, then arrival
        self.waiting.sort(key=lambda r: (int(r.rc), r.priority, r.arrival))
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            self.running[r.id] = r
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        if self.step_s:
            time.sleep(self.step_s)
        if self.busy_step_s:
            end = time.perf_counter() + self.busy_step_s
            x = 0
            while time.perf_counter() < end:
                x += 1
        for rid, r in list(self.running.items()):
            if FAIL_MARKER in r.prompt_text:
                # Like the real engine's containment: the request whose rows
                # break the step fails alone, retryable.
                del self.running[rid]
                err = RequestError(
                    "internal", f"engine step failed for this request: injected ({FAIL_MARKER})", retryable=True
                )
                outs.append(RequestOutput(rid, [], "", finished=True, finish_reason="error", error=err))
                continue
            if r.label_logprobs is not None:
                del self.running[rid]
                outs.append(
                    RequestOutput(
                        rid,
                        [],
                        "",
                        finished=True,
                        finish_reason="stop",
                        prompt_tokens=r.prompt_tokens + r.label_tokens,
                        label_logprobs=list(r.label_logprobs),
                    )
                )
                continue
            if r.held_first:
                r.held_first = False
                outs.append(RequestOutput(rid, [1], ""))  # a token, its text held back
                self.gate.clear()
                continue
            delta = r.resumed_text + (r.pieces[r.pos] if r.pos < len(r.pieces) else "")
            r.resumed_text = ""
            token = piece_token(r.pos)
            r.pos += 1
            if r.pos >= len(r.pieces):
                del self.running[rid]
                outs.append(
                    RequestOutput(
                        rid,
                        [token],
                        delta,
                        finished=True,
                        finish_reason=r.reason,
                        text=r.full,
                        prompt_tokens=r.prompt_tokens,
                        completion_tokens=len(r.pieces),
                    )
                )
            else:
                outs.append(RequestOutput(rid, [token], delta, completion_tokens=r.pos))
        return outs


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


def make_echo_engine(**kwargs: Any) -> EchoEngine:
    """Factory for ``jaxserve worker --engine tests.queue_support:make_echo_engine``."""
    cfg: dict[str, Any] = {
        "max_num_seqs": int(_env_float("JAXSERVE_ECHO_MAX_NUM_SEQS", 8)),
        "interactive_reserved_seqs": int(_env_float("JAXSERVE_ECHO_RESERVED", 2)),
        "max_model_len": int(_env_float("JAXSERVE_ECHO_MAX_MODEL_LEN", 512)),
        "step_s": _env_float("JAXSERVE_ECHO_STEP_S", 0.002),
    }
    for k, v in kwargs.items():
        if k in ("max_num_seqs", "interactive_reserved_seqs", "max_model_len", "break_after_steps"):
            cfg[k] = int(v)
        elif k in ("step_s", "busy_step_s", "warmup_s"):
            cfg[k] = float(v)
        else:
            cfg[k] = v
    return EchoEngine(**cfg)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Subprocess workers keep their default sqlite store here, not in ~/.local.
STATE_DIR = os.path.join(tempfile.gettempdir(), f"jaxserve-test-state-{os.getpid()}")


def worker_env(**extra: str) -> dict[str, str]:
    """Environment for a ``jaxserve`` subprocess run from the repository."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("JAXSERVE_STATE_DIR", STATE_DIR)
    env.update(extra)
    return env


def start_worker_process(
    prefix: str,
    log_path,
    *extra: str,
    engine: str | None = "tests.queue_support:make_echo_engine",
    env: dict | None = None,
):
    """``jaxserve worker`` as a subprocess (EchoEngine unless ``engine`` is
    None: then the real engine and its default model), JSON logs to
    ``log_path``."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "jaxserve.worker",
        "--amqp-url",
        AMQP_URL,
        "--prefix",
        prefix,
        "--heartbeat",
        "5",
        "--log-format",
        "json",
    ]
    if engine is not None:
        cmd += ["--engine", engine]
    return subprocess.Popen(
        [*cmd, *extra], cwd=REPO, env=env or worker_env(), stdout=open(log_path, "ab"), stderr=subprocess.STDOUT
    )


def wait_log(log_path, needle: str, timeout: float = 30.0) -> None:
    from pathlib import Path

    log_path = Path(log_path)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log_path.exists() and needle in log_path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else "(no log)"
    raise AssertionError(f"{needle!r} not in {log_path}:\n{tail}")


def read_jsonl(path) -> list[dict]:
    from pathlib import Path

    import orjson

    path = Path(path)
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def stop_process(proc, timeout: float = 15.0) -> None:
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def unique_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def rabbitmqctl(*args: str, timeout: float = 30.0) -> str:
    import subprocess

    return subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=timeout, check=True
    ).stdout


def unacked_counts(prefix: str) -> dict[str, int]:
    """Broker's view: messages_unacknowledged per queue of ``prefix``."""
    out = rabbitmqctl("list_queues", "name", "messages_unacknowledged", "messages_ready")
    counts: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith(prefix + "."):
            try:
                counts[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return counts


# ------------------------------------------------------------ the broker
import asyncio  # noqa: E402

AMQP_URL = os.environ.get("JAXSERVE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


async def delete_prefix(prefix: str) -> None:
    """Delete every queue of a test prefix (incl. reply queues) and its exchanges."""
    import aio_pika

    from jaxserve.wire.topology import Topology, delete_topology

    conn = await aio_pika.connect(AMQP_URL)
    try:
        await delete_topology(conn, Topology(prefix=prefix))
        try:
            out = await asyncio.to_thread(rabbitmqctl, "list_queues", "name")
        except Exception:  # noqa: BLE001
            out = ""
        ch = await conn.channel()
        for line in out.splitlines():
            name = line.strip()
            if name.startswith(prefix + "."):
                await ch.queue_delete(name)
    finally:
        await conn.close()


class WorkerHarness:
    """Starts in-process workers for one test and shuts them down after."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.workers: list = []

    async def start(self, engine: EchoEngine | None = None, store=None, **cfg):
        from jaxserve.wire.topology import Topology
        from jaxserve.worker.worker import Worker, WorkerConfig

        engine = engine or EchoEngine()
        topo_kw = {
            k: cfg.pop(k)
            for k in list(cfg)
            if k in ("delivery_limit", "interactive_max_length", "batch_max_length", "interactive_ttl_ms")
        }
        config = WorkerConfig(amqp_url=AMQP_URL, topology=Topology(prefix=self.prefix, **topo_kw), **cfg)
        w = Worker(lambda: engine, config, store=store)
        await w.start()
        self.workers.append(w)
        return w

    async def close(self) -> None:
        for w in self.workers:
            if not w.state.closing:
                if hasattr(w.host.engine, "unstall"):
                    w.host.engine.unstall()
                await w.shutdown(drain_timeout=0.5)


async def raw_publish(
    prefix: str,
    body: bytes,
    *,
    queue: str = "interactive",
    message_id: str | None = None,
    reply_to: str | None = None,
    correlation_id: str | None = None,
    content_type: str | None = "application/json",
    expiration=None,
) -> None:
    """Publish anything (bad jobs included) like a foreign AMQP client."""
    import types

    import aio_pika
    import aiormq.channel

    conn = await aio_pika.connect(AMQP_URL)
    saved = aiormq.channel.UUID
    try:
        ch = await conn.channel()
        if message_id is None:
            # aiormq fills in a random message_id; suppress it for this publish.
            aiormq.channel.UUID = lambda **_: types.SimpleNamespace(hex=None)
        await ch.default_exchange.publish(
            aio_pika.Message(
                body,
                message_id=message_id,
                reply_to=reply_to,
                correlation_id=correlation_id,
                content_type=content_type,
                expiration=expiration,
            ),
            routing_key=f"{prefix}.{queue}",
            mandatory=False,
        )
    finally:
        aiormq.channel.UUID = saved
        await conn.close()


async def wait_until(pred, timeout: float = 10.0, interval: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


# ------------------------------------------------------- a private Redis
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A redis-server of the test's own, on a free port, that the test may
    kill and restart without touching anyone else's."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("private redis did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
