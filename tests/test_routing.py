"""Routing by model against the real broker: jobs reach the queue
of the model they name, a model nobody serves is answered unknown_model at
once, and the worker-side pieces (jaxserve.worker.routing) find a fallback
and re-route a job to it exactly once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aio_pika
import orjson
import pytest
from click.testing import CliRunner

from jaxserve.batch.inputs import InputOptions, read_items
from jaxserve.batch.run import BatchSettings, run_batch
from jaxserve.client import AsyncClient, UnknownModel
from jaxserve.wire.topology import Topology, declare_topology
from jaxserve.worker.routing import (
    REROUTED_FROM,
    SERVE_AS,
    Fallback,
    ModelRoutes,
    RerouteError,
    declare_model_routes,
    find_fallback,
    remove_model_routes,
    reroute,
)
from queue_support import AMQP_URL, EchoEngine, expected_completion


async def _deploy(prefix: str, *routes: tuple[str, tuple[str, ...], bool]) -> Topology:
    """Declare the topology and, for each (served, aliases, default), its routes."""
    topo = Topology(prefix=prefix)
    conn = await aio_pika.connect(AMQP_URL)
    try:
        await declare_topology(conn, topo)
        for served, aliases, default in routes:
            await declare_model_routes(conn, ModelRoutes(topo, served=served, aliases=aliases, default=default))
    finally:
        await conn.close()
    return topo


async def _drain(conn: aio_pika.abc.AbstractConnection, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message ready in ``queue`` (acked)."""
    ch = await conn.channel()
    q = await ch.get_queue(queue, ensure=False)
    out = []
    while (msg := await q.get(no_ack=True, fail=False)) is not None:
        out.append(msg)
    await ch.close()
    return out


async def test_jobs_reach_the_queue_of_the_model_they_name(prefix, client):
    topo = await _deploy(prefix, ("alpha", ("chat",), True), ("beta", (), False), ("org/Gamma:v2", (), False))
    sent = {
        "none": await client.publish({"prompt": "x"}, expect_reply=False),
        "alpha": await client.publish({"prompt": "x", "model": "alpha"}, expect_reply=False),
        "chat": await client.publish({"prompt": "x", "model": "chat"}, expect_reply=False),
        "beta": await client.publish({"prompt": "x", "model": "beta"}, expect_reply=False),
        "beta-batch": await client.publish({"prompt": "x", "model": "beta"}, queue="batch", expect_reply=False),
        "gamma": await client.publish(b'{"prompt": "x", "model": "org/Gamma:v2"}', expect_reply=False),
    }
    conn = await aio_pika.connect(AMQP_URL)
    try:
        got = {
            name: sorted(m.message_id for m in await _drain(conn, name))
            for name in (
                topo.interactive,
                topo.batch,
                topo.model_queue("interactive", "beta"),
                topo.model_queue("batch", "beta"),
                topo.model_queue("interactive", "org/Gamma:v2"),
            )
        }
    finally:
        await conn.close()
    assert got == {
        topo.interactive: sorted([sent["none"], sent["alpha"], sent["chat"]]),
        topo.batch: [],
        f"{prefix}.interactive.beta": [sent["beta"]],
        f"{prefix}.batch.beta": [sent["beta-batch"]],
        topo.model_queue("interactive", "org/Gamma:v2"): [sent["gamma"]],
    }


async def test_an_unknown_model_is_answered_at_once_and_queued_nowhere(prefix, client):
    topo = await _deploy(prefix, ("alpha", (), True))
    # no worker runs at all: only the broker's return can answer these
    result = await client.submit("x", model="nope", key="k-nope", timeout=None)
    assert not result.ok and result.id == "k-nope" and result.error is not None
    assert result.error.code == "unknown_model" and "'nope'" in result.error.message and not result.error.retryable
    with pytest.raises(UnknownModel) as info:
        await client.submit("x", model="nope", raise_on_error=True)
    assert info.value.code == "unknown_model" and info.value.model == "nope"
    with pytest.raises(UnknownModel):
        await client.stream("x", model="alpha-typo")
    with pytest.raises(UnknownModel):  # a name no routing key can hold is nobody's model either
        await client.publish({"prompt": "x", "model": "m" * 300})
    assert not client._futures and not client._streams
    depths = await client.queue_depths([topo.model_queue("interactive", "nope")])
    assert depths[topo.interactive]["messages"] == 0 and depths[topo.batch]["messages"] == 0
    assert depths[f"{prefix}.interactive.nope"]["messages"] == -1  # never declared


async def test_cli_submit_unknown_model_exits_1_without_a_worker(prefix):
    from jaxserve.cli.queue_commands import submit

    await _deploy(prefix, ("alpha", (), True))
    res = await asyncio.to_thread(
        CliRunner().invoke,
        submit,
        ["x", "--prefix", prefix, "--amqp-url", AMQP_URL, "--json", "--model", "nope", "--timeout", "60"],
        catch_exceptions=False,
    )
    assert res.exit_code == 1
    assert json.loads(res.output.strip().splitlines()[-1])["error"]["code"] == "unknown_model"
    res = await asyncio.to_thread(
        CliRunner().invoke,
        submit,
        ["x", "--prefix", prefix, "--amqp-url", AMQP_URL, "--stream", "--model", "nope", "--timeout", "60"],
        catch_exceptions=False,
    )
    assert res.exit_code == 1 and "unknown_model" in res.output


async def test_cli_chat_unknown_model_is_one_error_line_and_the_chat_goes_on(prefix):
    """``jaxserve chat --model nope``: the refusal at the publish is printed
    as the turn's error, not a traceback, and the next line is read."""
    from jaxserve.cli.queue_commands import chat

    await _deploy(prefix, ("alpha", (), True))
    res = await asyncio.to_thread(
        CliRunner().invoke,
        chat,
        ["--prefix", prefix, "--amqp-url", AMQP_URL, "--model", "nope", "--timeout", "60"],
        input="hello\nagain\n\n",
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert res.output.count("[error unknown_model:") == 2 and "Traceback" not in res.output


async def test_without_the_models_exchange_the_worker_checks_the_name(harness, prefix, client):
    """A deployment whose workers declare no routes keeps today's behaviour."""
    await harness.start(EchoEngine(model_name="echo"))
    ok = await client.submit("hello world", model="echo", max_tokens=3, timeout=30)
    assert ok.ok and ok.text == expected_completion("hello world", 3)[0]
    bad = await client.submit("x", model="nope", timeout=30)
    assert bad.error is not None and bad.error.code == "unknown_model" and "this worker serves" in bad.error.message
    # once the worker's name is routed, a new client routes by it
    await _deploy(prefix, ("echo", (), True))
    fresh = await AsyncClient(AMQP_URL, prefix=prefix, name="test-routing-fresh").connect()
    try:
        ok = await fresh.submit("hello world", model="echo", max_tokens=3, timeout=30)
        assert ok.ok and ok.text == expected_completion("hello world", 3)[0]
        bad = await fresh.submit("x", model="nope", timeout=30)
        assert bad.error is not None and bad.error.code == "unknown_model" and "no worker routes" in bad.error.message
    finally:
        await fresh.delete_reply_queue()
        await fresh.close()


async def test_removed_routes_make_a_model_unknown(prefix, client):
    topo = await _deploy(prefix, ("alpha", (), True), ("beta", (), False))
    await client.publish({"prompt": "x", "model": "beta"}, expect_reply=False)
    conn = await aio_pika.connect(AMQP_URL)
    try:
        await remove_model_routes(conn, ModelRoutes(topo, served="beta"))
    finally:
        await conn.close()
    with pytest.raises(UnknownModel):
        await client.publish({"prompt": "x", "model": "beta"})


async def test_batch_routes_by_body_model_and_keeps_openai_lines(harness, prefix, tmp_path):
    await harness.start(EchoEngine(step_s=0.001, model_name="echo"))
    await _deploy(prefix, ("echo", (), True))
    lines = [
        {"custom_id": "c-1", "method": "POST", "url": "/v1/completions", "body": {"model": "echo", "prompt": "a b"}},
        {"custom_id": "c-2", "method": "POST", "url": "/v1/completions", "body": {"model": "gpt-9", "prompt": "c"}},
        {"custom_id": "c-3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "d e", "max_tokens": 2}},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    out = tmp_path / "out.jsonl"
    _, items = read_items(inp, InputOptions())
    settings = BatchSettings(amqp_url=AMQP_URL, prefix=prefix, progress=False, idle_timeout=60)
    summary = await asyncio.to_thread(run_batch, items, out, settings)
    got = {x["custom_id"]: x for x in map(orjson.loads, Path(out).read_bytes().splitlines())}
    assert summary.ok == 2 and summary.errors == {"unknown_model": 1} and summary.missing == 0
    assert got["c-2"]["response"] is None and got["c-2"]["error"]["code"] == "unknown_model"
    for cid in ("c-1", "c-3"):
        assert set(got[cid]) == {"id", "custom_id", "response", "error"} and got[cid]["error"] is None
        assert got[cid]["response"]["body"]["object"] == "text_completion"
        assert got[cid]["response"]["body"]["model"] == "echo"


async def test_find_fallback_wants_a_consumer_and_room(prefix):
    topo = await _deploy(prefix, ("alpha", (), True), ("beta", (), False), ("gamma", (), False))
    conn = await aio_pika.connect(AMQP_URL)
    try:
        assert await find_fallback(conn, topo, ["zeta", "beta", "gamma"], "interactive") is None  # no consumers
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=1)
        gamma_q = await ch.get_queue(topo.model_queue("interactive", "gamma"), ensure=False)
        held: asyncio.Queue = asyncio.Queue()
        await gamma_q.consume(held.put)  # holds what it gets, unacked
        found = await find_fallback(conn, topo, ["zeta", "beta", "gamma"], "interactive")
        assert found == Fallback(model="gamma", queue=f"{prefix}.interactive.gamma", ready=0, consumers=1)
        assert await find_fallback(conn, topo, ["gamma"], "batch") is None  # gamma's batch queue has no consumer
        # the default model is found by its single-model queue
        alpha_ch = await conn.channel()
        alpha_q = await alpha_ch.get_queue(topo.interactive, ensure=False)
        await alpha_q.consume(held.put)
        found = await find_fallback(conn, topo, ["alpha"], "interactive", default_model="alpha")
        assert found is not None and found.queue == topo.interactive
        # a job waiting behind gamma's full prefetch window: no room
        pub = await conn.channel()
        for _ in range(2):
            await pub.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=f"{prefix}.interactive.gamma")
        await held.get()
        await _until_ready(conn, f"{prefix}.interactive.gamma", 1)
        assert await find_fallback(conn, topo, ["gamma"], "interactive") is None
        found = await find_fallback(conn, topo, ["gamma"], "interactive", max_ready=1)
        assert found is not None and found.ready == 1
    finally:
        await conn.close()


async def _until_ready(conn: aio_pika.abc.AbstractConnection, queue: str, ready: int) -> None:
    """Wait (bounded by the test timeout) until ``queue`` reports ``ready``
    messages: a quorum queue's count follows a publish confirm closely, not
    at once."""
    while True:
        ch = await conn.channel()
        q = await ch.declare_queue(queue, passive=True)
        await ch.close()
        if q.declaration_result.message_count == ready:
            return
        await asyncio.sleep(0.05)


async def test_reroute_copies_the_job_once_with_its_properties(prefix, client):
    topo = await _deploy(prefix, ("alpha", (), True), ("beta", (), False))
    key = await client.publish(
        {"prompt": "x", "model": "alpha", "fallback_models": ["beta"]}, expect_reply=False, expiration=60
    )
    conn = await aio_pika.connect(AMQP_URL)
    try:
        (original,) = await _drain(conn, topo.interactive)
        target = Fallback(model="beta", queue=topo.model_queue("interactive", "beta"), ready=0, consumers=1)
        await reroute(conn, original, target, from_model="alpha")
        (copy,) = await _drain(conn, target.queue)
        assert copy.body == original.body and copy.message_id == key == original.message_id
        assert (copy.reply_to, copy.correlation_id) == (client.reply_queue, key)
        assert copy.headers[REROUTED_FROM] == "alpha" and copy.headers[SERVE_AS] == "beta"
        assert copy.headers["x-published-at-ms"] == original.headers["x-published-at-ms"]
        assert copy.expiration == original.expiration == 60
        with pytest.raises(RerouteError, match="once already"):
            await reroute(conn, copy, target, from_model="beta")
        gone = Fallback(model="delta", queue=topo.model_queue("interactive", "delta"), ready=0, consumers=1)
        with pytest.raises(RerouteError, match="gone"):
            await reroute(conn, original, gone, from_model="alpha")
    finally:
        await conn.close()


async def _hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """A consumer that keeps what it gets, unacked."""


async def test_status_shows_queues_and_consumers_per_model(prefix):
    from jaxserve.cli.queue_commands import status

    topo = await _deploy(prefix, ("alpha", (), True), ("beta", (), False))
    conn = await aio_pika.connect(AMQP_URL)
    try:
        ch = await conn.channel()
        await ch.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=topo.model_queue("batch", "beta"))
        beta_q = await ch.get_queue(topo.model_queue("interactive", "beta"), ensure=False)
        await beta_q.consume(_hold)
        base = ["--prefix", prefix, "--amqp-url", AMQP_URL, "--json"]
        res = await asyncio.to_thread(CliRunner().invoke, status, [*base, "--no-broker-details", "--model", "beta"])
        depths = json.loads(res.output.strip().splitlines()[-1])
        assert depths[f"{prefix}.interactive.beta"] == {
            "messages": 0,
            "consumers": 1,
            "model": "beta",
            "class": "interactive",
        }
        assert depths[f"{prefix}.batch.beta"]["model"] == "beta" and depths[f"{prefix}.batch.beta"]["consumers"] == 0
        assert depths[topo.interactive]["model"] is None and depths[topo.interactive]["class"] == "interactive"
        # rabbitmqctl finds every model's queues by itself
        res = await asyncio.to_thread(CliRunner().invoke, status, [*base, "--broker-details"])
        depths = json.loads(res.output.strip().splitlines()[-1])
        assert depths[f"{prefix}.interactive.beta"]["consumers"] == 1
        assert depths[f"{prefix}.batch.beta"]["messages"] + depths[f"{prefix}.batch.beta"]["unacked"] == 1
        res = await asyncio.to_thread(CliRunner().invoke, status, base[:-1] + ["--broker-details"])
        assert res.exit_code == 0
        table = res.output
        assert "beta" in table and "(default)" in table
        idle = next(line for line in table.splitlines() if line.startswith("no consumer on"))
        assert f"{prefix}.interactive," in idle and f"{prefix}.interactive.beta" not in idle
    finally:
        await conn.close()
