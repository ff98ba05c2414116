"""gateway: the OpenAI door against the queue's own producers, on one worker.

One ``jaxserve worker`` (``--model``, default ``bench/models.py``) and one
``jaxserve gateway`` on its prefix stay up for the whole scenario (start-up
and compilation not timed); two pairs of systems alternate over the rounds:

- **TTFT.** ``gateway-stream``: ``--samples`` streamed chats, one after the
  other, through the gateway with the ``openai`` SDK's ``AsyncOpenAI`` (one
  client, its connection kept: the synchronous ``OpenAI`` stream closes its
  response at ``[DONE]`` before the chunked end, so each of its streams
  connects anew, whatever the server); TTFT = the request sent to the first
  chunk the SDK yields. ``submit-stream``: the same chats as ``jaxserve submit --stream``
  sends them (the reference client's ``stream`` on a connected client,
  the command's own code path, without the command's interpreter start);
  TTFT = publish to the first chunk. Every chat's prompt is new in every
  round (a round and sample number in it) and carries ``cache: false``, so
  none is answered from the response cache. Figure: p50 of each, the
  gateway's over the client's (goal <= 1.1x).
- **Throughput.** ``gateway-sdk``: ``--jobs`` chat completions sent by
  ``--clients`` (64) concurrent SDK clients (``AsyncOpenAI``, one task each,
  taking the next job until none is left), with ``X-Jaxserve-Queue: batch``
  so they wait in the batch queue as ``jaxserve batch``'s jobs do;
  ``batch-cli``: the same jobs as an OpenAI Batch file through ``jaxserve
  batch`` (a subprocess; its start is timed, as a user waits for it).
  Figure: jobs/s, the gateway's over the CLI's (goal >= 0.9x). The two get
  the same jobs but for a round number in each prompt (new in every turn,
  so the engine's prefix cache favours neither), greedy, distinct and with
  ``cache: false``, so neither side deduplicates nor hits the cache.

``--smoke`` shrinks it (the tiny preset unless ``--model`` is given, 3
samples, 16 jobs, 8 clients): a check that it runs, never a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from .. import models, rounds
from ..record import Figure

NAME = "gateway"
DESCRIPTION = (
    "the OpenAI gateway vs the queue's producers on one worker: streamed-chat TTFT vs jaxserve submit --stream, "
    "64 SDK clients' jobs/s vs jaxserve batch"
)
COMMAND = ".venv/bin/python benchmarks/suite.py run gateway"
LABELS = {
    "gateway-stream": "gateway, OpenAI SDK stream",
    "submit-stream": "jaxserve submit --stream",
    "gateway-sdk": "gateway, concurrent OpenAI SDK clients",
    "batch-cli": "jaxserve batch",
}
QUESTION = "In two sentences, what is a message queue? (round {r}, item {i})"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: SmolLM2-135M (the tiny preset with --smoke)")
    p.add_argument("--samples", type=int, default=20, help="streamed chats per TTFT turn")
    p.add_argument("--stream-max-tokens", type=int, default=16)
    p.add_argument("--jobs", type=int, default=512, help="jobs per throughput turn")
    p.add_argument("--clients", type=int, default=64, help="concurrent SDK clients")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the throughput jobs")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--worker-arg", action="append", default=[], help="extra `jaxserve worker` flag (repeatable)")


class Stack:
    """The worker and the gateway every contender talks to."""

    def __init__(self, args: argparse.Namespace, ctx: Any) -> None:
        import queue_common as qc  # benchmarks/ is on sys.path (suite.py)

        self.qc = qc
        self.prefix = qc.new_prefix("gw")
        self.model = args.model
        engine = {"model": args.model, "max_model_len": args.max_model_len}
        extra = ["--max-num-seqs", str(args.max_num_seqs), "--store", "memory", *args.worker_arg]
        self.worker = qc.WorkerProc(self.prefix, engine, extra, ctx.tmp / "worker.log")
        self.startup_s = self.worker.wait_consuming(timeout=900)
        self.port = qc.free_port()
        self.gateway_log = open(ctx.tmp / "gateway.log", "wb")
        self.gateway = subprocess.Popen(
            [
                qc.jaxserve_exe(),
                "gateway",
                "--amqp-url",
                qc.AMQP_URL,
                "--prefix",
                self.prefix,
                "--port",
                str(self.port),
                "--state-dir",
                str(ctx.tmp / "gateway-state"),
                "--log-format",
                "json",
                "--log-level",
                "warning",  # no line per request: the log's writes must not be what is measured
            ],
            stdout=self.gateway_log,
            stderr=subprocess.STDOUT,
        )
        self._wait_gateway()
        self.served = self._served_name()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _wait_gateway(self, timeout: float = 60.0) -> None:
        import urllib.error
        import urllib.request

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.gateway.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise RuntimeError("the gateway did not answer")

    def _served_name(self) -> str:
        import openai

        names = [m.id for m in openai.OpenAI(base_url=self.url, api_key="bench").models.list().data]
        if not names:
            raise RuntimeError("the gateway lists no model: is rabbitmqctl on PATH (or --management-url given)?")
        return names[0]

    def stop(self) -> None:
        if self.gateway.poll() is None:
            self.gateway.terminate()
            try:
                self.gateway.wait(20)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
        self.gateway_log.close()
        self.worker.stop()
        asyncio.run(_drop_prefix(self.qc.AMQP_URL, self.prefix, self.qc.leftover_queues(self.prefix)))


async def _drop_prefix(amqp_url: str, prefix: str, leftovers: list[str]) -> None:
    """Every queue and exchange of the prefix: the topology (the models
    exchange and the default model's record included) and the reply queues."""
    import aio_pika

    from jaxserve.wire.topology import Topology, delete_topology

    conn = await aio_pika.connect(amqp_url)
    try:
        await delete_topology(conn, Topology(prefix=prefix))
        channel = await conn.channel()
        for name in leftovers:
            await channel.queue_delete(name)
    finally:
        await conn.close()


def _messages(rnd: int, i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTION.format(r=rnd, i=i)}]


class GatewayStream:
    name = "gateway-stream"

    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.stack, self.args, self.turns = stack, args, 0

    def start(self) -> dict[str, Any]:
        return {"worker_startup_s": round(self.stack.startup_s, 1)}

    def turn(self) -> dict[str, Any]:
        self.turns += 1
        return asyncio.run(self._turn(self.turns))

    async def _turn(self, rnd: int) -> dict[str, Any]:
        import openai

        # a client per turn, as SubmitStream connects one: each turn runs in its own event loop
        sdk = openai.AsyncOpenAI(base_url=self.stack.url, api_key="bench", max_retries=0, timeout=300)
        ttfts = []
        try:
            for i in range(self.args.samples):
                t0 = time.perf_counter()
                stream = await sdk.chat.completions.create(
                    model=self.stack.served,
                    messages=_messages(rnd, i),
                    max_tokens=self.args.stream_max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"cache": False},
                )
                first = None
                async for _ in stream:
                    if first is None:
                        first = time.perf_counter() - t0
                if first is None:
                    return {"ok": False, "error": "a stream without a chunk"}
                ttfts.append(first)
        finally:
            await sdk.close()
        return {"ok": True, "value": round(1000 * statistics.median(ttfts), 2), "ttft_ms": [1000 * t for t in ttfts]}

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


class SubmitStream:
    name = "submit-stream"

    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.stack, self.args, self.turns = stack, args, 0

    def start(self) -> dict[str, Any]:
        return {}

    def turn(self) -> dict[str, Any]:
        self.turns += 1
        return asyncio.run(self._turn(self.turns))

    async def _turn(self, rnd: int) -> dict[str, Any]:
        from jaxserve.client import AsyncClient

        client = await AsyncClient(self.stack.qc.AMQP_URL, prefix=self.stack.prefix, name="jaxserve-submit").connect()
        ttfts = []
        try:
            for i in range(self.args.samples):
                t0 = time.monotonic()
                s = await client.stream(
                    messages=_messages(1000 + rnd, i),
                    queue="interactive",
                    timeout=300,
                    model=self.stack.served,
                    max_tokens=self.args.stream_max_tokens,
                    temperature=0,
                    cache=False,
                )
                async for _ in s:
                    pass
                if s.first_chunk_at is None:
                    return {"ok": False, "error": "a stream without a chunk"}
                ttfts.append(s.first_chunk_at - t0)
        finally:
            await client.delete_reply_queue()
            await client.close()
        return {"ok": True, "value": round(1000 * statistics.median(ttfts), 2), "ttft_ms": [1000 * t for t in ttfts]}

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


class GatewaySdk:
    name = "gateway-sdk"

    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.stack, self.args, self.turns = stack, args, 0

    def start(self) -> dict[str, Any]:
        return {}

    def turn(self) -> dict[str, Any]:
        self.turns += 1
        return asyncio.run(self._turn(self.turns))

    async def _turn(self, rnd: int) -> dict[str, Any]:
        import openai

        jobs = list(range(self.args.jobs))
        failures: list[str] = []
        done = 0

        async def one_client() -> None:
            nonlocal done
            sdk = openai.AsyncOpenAI(base_url=self.stack.url, api_key="bench", max_retries=8, timeout=600)
            try:
                while jobs:
                    i = jobs.pop()
                    try:
                        await sdk.chat.completions.create(
                            model=self.stack.served,
                            messages=_messages(rnd, i),
                            max_tokens=self.args.max_tokens,
                            temperature=0,
                            extra_body={"cache": False},
                            extra_headers={"X-Jaxserve-Queue": "batch"},
                        )
                        done += 1
                    except openai.APIError as exc:
                        failures.append(repr(exc)[:200])
            finally:
                await sdk.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(self.args.clients)))
        wall = time.perf_counter() - t0
        if failures:
            return {"ok": False, "error": f"{len(failures)} failed", "first": failures[0]}
        return {"ok": True, "value": round(done / wall, 3), "wall_s": round(wall, 2), "jobs": done}

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


class BatchCli:
    name = "batch-cli"

    def __init__(self, stack: Stack, args: argparse.Namespace, tmp: Path) -> None:
        self.stack, self.args, self.tmp, self.turns = stack, args, tmp, 0

    def start(self) -> dict[str, Any]:
        return {}

    def turn(self) -> dict[str, Any]:
        self.turns += 1
        rnd = 2000 + self.turns  # other prompts than the SDK's: nothing is answered from the store
        src = self.tmp / f"batch-{self.turns}.jsonl"
        out = self.tmp / f"batch-{self.turns}-out.jsonl"
        with open(src, "w") as f:
            for i in range(self.args.jobs):
                body = {
                    "model": self.stack.served,
                    "messages": _messages(rnd, i),
                    "max_tokens": self.args.max_tokens,
                    "temperature": 0,
                    "cache": False,
                }
                f.write(
                    json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
                )
                f.write("\n")
        cmd = [
            self.stack.qc.jaxserve_exe(),
            "batch",
            str(src),
            "-o",
            str(out),
            "--amqp-url",
            self.stack.qc.AMQP_URL,
            "--prefix",
            self.stack.prefix,
            "--no-progress",
            "--batch-id",
            uuid.uuid4().hex[:16],
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
        lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        ok = sum(1 for x in lines if x.get("error") is None)
        if proc.returncode != 0 or ok != self.args.jobs:
            return {"ok": False, "error": f"rc {proc.returncode}, {ok} ok", "stderr_tail": proc.stderr[-1500:]}
        return {"ok": True, "value": round(ok / wall, 3), "wall_s": round(wall, 2), "jobs": ok}

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    if args.model is None:
        args.model = "tiny" if ctx.smoke else models.jaxserve_default()
    if ctx.smoke:
        args.samples, args.jobs, args.clients = min(args.samples, 3), min(args.jobs, 16), min(args.clients, 8)
    stack = Stack(args, ctx)
    try:
        ttft = rounds.alternate(
            [GatewayStream(stack, args), SubmitStream(stack, args)], ctx.rounds, ctx.warmup_rounds, pause=False
        )
        rate = rounds.alternate(
            [GatewaySdk(stack, args), BatchCli(stack, args, ctx.tmp)], ctx.rounds, ctx.warmup_rounds, pause=False
        )
    finally:
        stack.stop()
    label = models.label(args.model)
    figs = [
        rounds.figure(
            ttft,
            f"p50 TTFT of a streamed chat ({args.samples} per round), {label}, one worker",
            "gateway-stream",
            "submit-stream",
            "ms",
            labels=LABELS,
            goal="<= 1.1x",
            goal_ratio=1.1,
            higher_is_better=False,
        ),
        rounds.figure(
            rate,
            f"{args.jobs} chat jobs: {args.clients} concurrent SDK clients vs jaxserve batch, {label}, one worker",
            "gateway-sdk",
            "batch-cli",
            "jobs/s",
            labels=LABELS,
            goal=">= 0.9x",
            goal_ratio=0.9,
        ),
    ]
    settings = dict(vars(args))
    settings["worker_command"] = stack.worker.cmd
    return figs, ttft + rate, settings
