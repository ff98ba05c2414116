"""Routing by model, fallbacks and degraded answers, worker side,
against the real broker: two workers serve two models on one prefix, jobs
reach the worker of the model they name, an unknown model is answered at
once, and a job that would be ``overloaded`` is answered by its fallback
model, or with its degraded ``max_tokens``, when it asked for that, and
refused as before when it did not (``jaxserve.worker.fallback``)."""

from __future__ import annotations

import asyncio

import aio_pika
import orjson
import pytest

from jaxserve.wire import INTERACTIVE
from jaxserve.worker.admission import AdmissionConfig
from jaxserve.worker.routing import REROUTED_FROM, SERVE_AS
from queue_support import (
    AMQP_URL,
    EchoEngine,
    expected_completion,
    read_jsonl,
    start_worker_process,
    stop_process,
    wait_log,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

PROMPT = "hello world"  # 11 ByteTokenizer tokens: a budget of 16 holds one such prompt, not two


def _worker(prefix: str, log, model: str, *extra: str, store: str = "memory"):
    """``jaxserve worker`` serving the echo engine as ``model``."""
    return start_worker_process(
        prefix,
        log,
        "--engine-arg",
        f"model_name={model}",
        "--store",
        store,
        "--engine-thread",
        "--drain-timeout",
        "0.5",
        *extra,
    )


def _events(log, event: str) -> list[dict]:
    return [x for x in read_jsonl(log) if x.get("event") == event]


async def _logged(log, event: str, keys: set[str]) -> set[str]:
    """The keys of ``event`` lines once every one of ``keys`` has one (a
    worker logs job_done just after the reply that the test already has)."""
    await wait_until(lambda: keys <= {x.get("key") for x in _events(log, event)}, timeout=30)
    return {x["key"] for x in _events(log, event)}


def _start_both(prefix: str, tmp_path, *alpha_extra: str, store: str = "memory") -> tuple:
    """alpha is the deployment's default model; beta (alias b-alias) has queues of its own."""
    alpha_log, beta_log = tmp_path / "alpha.log", tmp_path / "beta.log"
    alpha = _worker(prefix, alpha_log, "alpha", *alpha_extra, store=store)
    beta = _worker(
        prefix,
        beta_log,
        "beta",
        "--served-model-name",
        "beta",
        "--served-model-name",
        "b-alias",
        "--default-model",
        "alpha",
        store=store,
    )
    try:
        wait_log(alpha_log, "worker_consuming", timeout=90)
        wait_log(beta_log, "worker_consuming", timeout=90)
    except BaseException:
        stop_process(alpha)
        stop_process(beta)
        raise
    return alpha, beta, alpha_log, beta_log


async def test_two_workers_serve_two_models_by_name(prefix, client, tmp_path):
    alpha, beta, alpha_log, beta_log = await asyncio.to_thread(_start_both, prefix, tmp_path)
    try:
        want = expected_completion(PROMPT, 3)[0]
        results = {
            name: await client.submit(PROMPT, max_tokens=3, timeout=60, **kw)
            for name, kw in {
                "none": {},
                "alpha": {"model": "alpha"},
                "beta": {"model": "beta"},
                "b-alias": {"model": "b-alias"},
                "beta-batch": {"model": "beta", "queue": "batch"},
            }.items()
        }
        for name, result in results.items():
            assert result.ok and result.text == want, (name, result)
            assert result.degraded is None, (name, result)
        served = {name: (r.model, r.served_model) for name, r in results.items()}
        assert served == {
            "none": ("alpha", "alpha"),
            "alpha": ("alpha", "alpha"),
            "beta": ("beta", "beta"),
            "b-alias": ("beta", "beta"),  # an alias is answered under the served name
            "beta-batch": ("beta", "beta"),
        }
        on_alpha = {results["none"].id, results["alpha"].id}
        on_beta = {results["beta"].id, results["b-alias"].id, results["beta-batch"].id}
        assert await _logged(alpha_log, "job_done", on_alpha) == on_alpha
        assert await _logged(beta_log, "job_done", on_beta) == on_beta
        # each consumes its own queues: beta never the default model's
        depths = await client.queue_depths([f"{prefix}.interactive.beta", f"{prefix}.batch.beta"])
        assert {q: depths[q]["consumers"] for q in depths if q.startswith(f"{prefix}.interactive")} == {
            f"{prefix}.interactive": 1,
            f"{prefix}.interactive.beta": 1,
        }

        # a model nobody serves: answered by the broker's return, queued nowhere, seen by no worker
        unknown = await client.submit(PROMPT, model="gamma", key="k-gamma", timeout=60)
        assert not unknown.ok and unknown.error is not None and unknown.error.code == "unknown_model"
        assert "no worker routes" in unknown.error.message and not unknown.error.retryable
        after = await client.queue_depths([f"{prefix}.interactive.gamma"])
        assert after[f"{prefix}.interactive"]["messages"] == 0
        assert after[f"{prefix}.interactive.gamma"]["messages"] == -1  # never declared
    finally:
        await asyncio.to_thread(stop_process, alpha)
        await asyncio.to_thread(stop_process, beta)
    for log in (alpha_log, beta_log):
        assert not any(x.get("key") == "k-gamma" for x in read_jsonl(log))


async def _ask_each(client, models: dict[str, str], n: int = 4) -> None:
    """``n`` interactive and ``n`` batch jobs naming each model (and, under
    "", naming none): every one answered ok by the model it names."""
    keys = {
        (asked, i, qc): await client.publish(
            {"prompt": PROMPT, "max_tokens": 2, **({"model": asked} if asked else {})}, queue=qc
        )
        for asked in models
        for i in range(n)
        for qc in ("interactive", "batch")
    }
    for (asked, _, qc), key in keys.items():
        r = await client.wait(key, timeout=60)
        assert r.ok and r.served_model == models[asked], (asked, qc, r.raw)


async def test_two_models_started_the_plain_way_each_serve_their_own_jobs(harness, prefix, client):
    """``jaxserve worker --model tiny`` and the same preset ``--served-model-name
    smol``, neither told which is the default: the first takes the default
    queues, the second its own, and every job is answered by the model it
    names. A job naming tiny while tiny's worker is stopped waits for tiny
    (smol neither takes nor answers it); a restarted tiny serves it."""
    tiny = await harness.start(EchoEngine(model_name="tiny"), model_routes=True, drain_timeout=0.5)
    smol = await harness.start(EchoEngine(model_name="tiny"), model_routes=True, served_model_name="smol")
    await _ask_each(client, {"tiny": "tiny", "smol": "smol", "": "tiny"})
    assert smol.stats["invalid"] == tiny.stats["invalid"] == 0
    assert (
        tiny.connections.routes is not None
        and tiny.connections.routes.default
        and tiny.connections.routes.default_model == "tiny"
    )
    assert (
        smol.connections.routes is not None
        and not smol.connections.routes.default
        and smol.connections.routes.default_model == "tiny"
    )

    await tiny.shutdown(drain_timeout=0.5)
    stray = await client.publish({"prompt": PROMPT, "max_tokens": 2, "model": "tiny"})
    await _ask_each(client, {"smol": "smol"}, n=2)  # smol keeps serving its own
    depths = await client.queue_depths()
    assert depths[f"{prefix}.interactive"] == {"messages": 1, "consumers": 0}  # waiting for tiny
    assert smol.stats["received"] == 2 * 4 + 2 * 2
    again = await harness.start(EchoEngine(model_name="tiny"), model_routes=True)
    assert again.connections.routes is not None and again.connections.routes.default
    waited = await client.wait(stray, timeout=60)
    assert waited.ok and waited.served_model == "tiny"


async def test_the_default_is_whoever_started_first_and_old_routes_are_moved(harness, prefix, client):
    """The other order, on a prefix where tiny's names were bound to the
    default queues before the default was claimed (a worker of the
    previous release): smol starts first and becomes the default; tiny,
    started after, takes its names off the default queues, so smol never
    sees a job naming tiny."""
    from jaxserve.wire.topology import Topology, declare_topology
    from jaxserve.worker.routing import ModelRoutes, declare_model_routes

    topo = Topology(prefix=prefix)
    conn = await aio_pika.connect(AMQP_URL)
    try:
        await declare_topology(conn, topo)
        await declare_model_routes(conn, ModelRoutes(topo, served="tiny", default=True))
    finally:
        await conn.close()
    smol = await harness.start(EchoEngine(model_name="tiny"), model_routes=True, served_model_name="smol")
    tiny = await harness.start(EchoEngine(model_name="tiny"), model_routes=True)
    await _ask_each(client, {"tiny": "tiny", "smol": "smol", "": "smol"})
    assert smol.connections.routes is not None and smol.connections.routes.default
    assert (
        tiny.connections.routes is not None
        and not tiny.connections.routes.default
        and tiny.connections.routes.default_model == "smol"
    )
    assert (smol.stats["received"], tiny.stats["received"]) == (16, 8)  # smol: its own and those naming none
    assert smol.stats["invalid"] == tiny.stats["invalid"] == 0


async def test_a_model_started_after_the_default_is_gone_takes_the_default(harness, prefix, client):
    """tiny served and stopped, then smol started plainly (a user trying one
    model, then another): smol takes the default over, so jobs naming no
    model are served, and tiny's name leaves the default queues, so a job
    naming tiny is refused unknown_model at once instead of reaching smol.
    Two models starting at the same moment never both become the default."""
    tiny = await harness.start(EchoEngine(model_name="tiny"), model_routes=True)
    await _ask_each(client, {"": "tiny"}, n=1)
    await tiny.shutdown(drain_timeout=0.5)
    smol = await harness.start(EchoEngine(model_name="tiny"), model_routes=True, served_model_name="smol")
    await _ask_each(client, {"": "smol", "smol": "smol"}, n=2)
    refused = await client.submit(PROMPT, model="tiny", timeout=30)
    assert refused.error is not None and refused.error.code == "unknown_model", refused.raw
    assert "no worker routes" in refused.error.message and smol.stats["invalid"] == 0
    assert smol.connections.routes is not None and smol.connections.routes.default

    await smol.shutdown(drain_timeout=0.5)
    together = await asyncio.gather(
        *(harness.start(EchoEngine(model_name=name), model_routes=True) for name in ("alpha", "beta", "gamma"))
    )
    assert sum(w.connections.routes.default for w in together) == 1
    await _ask_each(client, {name: name for name in ("alpha", "beta", "gamma")}, n=1)


async def test_default_model_naming_this_model_while_another_runs_is_one_error(harness, prefix):
    from jaxserve.wire.topology import Topology
    from jaxserve.worker.routing import DefaultModelConflict
    from jaxserve.worker.worker import Worker, WorkerConfig

    await harness.start(EchoEngine(model_name="tiny"), model_routes=True)
    cfg = WorkerConfig(amqp_url=AMQP_URL, topology=Topology(prefix=prefix), model_routes=True, default_model="smol")
    smol = Worker(lambda: EchoEngine(model_name="smol"), cfg)
    try:
        with pytest.raises(DefaultModelConflict, match="--default-model 'smol' names this worker's model, but 1 "):
            await smol.start()
    finally:
        await smol.shutdown(drain_timeout=0.0)


async def test_a_job_naming_another_model_that_strays_here_is_refused_not_answered(harness, prefix, client):
    """The engine's own name is not one of a worker's names when it is served
    under another: a job naming tiny published straight to smol's queue is
    unknown_model, never an ok answer from smol."""
    await harness.start(EchoEngine(model_name="tiny"), model_routes=True, served_model_name="smol")
    stray = await client.publish({"prompt": PROMPT, "model": "tiny"}, queue=f"{prefix}.interactive")
    r = await client.wait(stray, timeout=60)
    assert r.error is not None and r.error.code == "unknown_model" and "'smol'" in r.error.message


async def test_an_overloaded_job_goes_to_its_fallback_and_one_without_is_refused(prefix, client, tmp_path):
    """alpha's engine is stalled and its admission budget holds one prompt:
    once the first job holds it, every further alpha job is overloaded. The
    two share a Redis store, as a deployment's workers do."""
    alpha, beta, alpha_log, beta_log = await asyncio.to_thread(
        _start_both, prefix, tmp_path, "--engine-arg", "stalled=1", "--max-queued-tokens", "16", store="redis"
    )
    try:
        first = await client.publish({"prompt": PROMPT, "model": "alpha", "max_tokens": 3})
        await asyncio.to_thread(wait_log, alpha_log, "job_start", 30)

        moved = await client.submit(PROMPT, model="alpha", fallback_models=["gamma", "beta"], max_tokens=3, timeout=60)
        assert moved.ok and moved.text == expected_completion(PROMPT, 3)[0], moved
        assert (moved.model, moved.served_model, moved.degraded) == ("beta", "beta", ["model"])
        await _logged(alpha_log, "job_rerouted", {moved.id})
        (rerouted,) = _events(alpha_log, "job_rerouted")
        assert rerouted["key"] == moved.id and rerouted["to"] == "beta"
        await _logged(beta_log, "job_done", {moved.id})

        refused = await client.submit(PROMPT, model="alpha", max_tokens=3, timeout=60)
        assert refused.error is not None and refused.error.code == "overloaded" and refused.error.retryable
        assert refused.error.retry_after_s is not None and refused.error.retry_after_s > 0

        # a fallback nobody consumes has no room: refused as today
        nowhere = await client.submit(PROMPT, model="alpha", fallback_models=["gamma"], max_tokens=3, timeout=60)
        assert nowhere.error is not None and nowhere.error.code == "overloaded"
        assert len(_events(alpha_log, "job_rerouted")) == 1
        assert first not in {x["key"] for x in _events(alpha_log, "job_done")}  # still stalled
    finally:
        await asyncio.to_thread(stop_process, alpha)
        await asyncio.to_thread(stop_process, beta)


async def _publish_copy(prefix: str, key: str, body: dict, headers: dict, client) -> None:
    """A job as a re-routed copy arrives: published to alpha's queue with the routing headers."""
    conn = await aio_pika.connect(AMQP_URL)
    try:
        ch = await conn.channel(publisher_confirms=True)
        await ch.default_exchange.publish(
            aio_pika.Message(
                orjson.dumps(body),
                message_id=key,
                correlation_id=key,
                reply_to=client.reply_queue,
                content_type="application/json",
                headers=headers,
            ),
            routing_key=f"{prefix}.interactive",
        )
    finally:
        await conn.close()


async def test_degraded_max_tokens_and_no_second_reroute(harness, prefix, client):
    """In-process workers, so the test can stall and unstall alpha's engine."""
    alpha_engine = EchoEngine(model_name="alpha", stalled=True)
    alpha = await harness.start(
        alpha_engine, model_routes=True, admission=AdmissionConfig(max_queued_tokens=16), drain_timeout=0.5
    )
    beta = await harness.start(EchoEngine(model_name="beta"), model_routes=True, default_model="alpha")
    assert alpha.connections.routes is not None and alpha.connections.routes.default
    assert beta.connections.routes is not None and not beta.connections.routes.default
    first = await client.publish({"prompt": PROMPT, "model": "alpha", "max_tokens": 3})
    await wait_until(lambda: alpha_engine.add_count[first] == 1, timeout=30)

    # a copy that was re-routed once is never re-routed again, though beta has room
    copy = {"prompt": PROMPT, "model": "gamma", "fallback_models": ["beta"], "max_tokens": 3}
    waiting = asyncio.ensure_future(client.wait("copy-1", timeout=60))  # its reply may come at once
    await asyncio.sleep(0)
    await _publish_copy(prefix, "copy-1", copy, {REROUTED_FROM: "gamma", SERVE_AS: "alpha"}, client)
    again = await waiting
    assert again.error is not None and again.error.code == "overloaded"
    assert alpha.stats["rerouted"] == alpha.stats["reroute_failed"] == 0 and beta.stats["received"] == 0

    degraded_key = await client.publish(
        {"prompt": PROMPT, "model": "alpha", "max_tokens": 8, "degrade": {"max_tokens": 2}, "temperature": 0}
    )
    await wait_until(lambda: alpha_engine.add_count[degraded_key] == 1, timeout=30)
    alpha_engine.unstall()
    degraded = await client.wait(degraded_key, timeout=60)
    assert degraded.ok and degraded.degraded == ["max_tokens"] and degraded.served_model == "alpha"
    assert degraded.usage is not None and degraded.usage.completion_tokens == 2
    assert degraded.text == expected_completion(PROMPT, 2)[0]
    assert (await client.wait(first, timeout=60)).degraded is None
    assert alpha.served is not None
    count = alpha.served.metrics.degradations.labels("alpha", INTERACTIVE, "max_tokens")._value.get()
    assert count == 1 and alpha.stats["degraded_max_tokens"] == 1

    # a degraded answer is not the cached answer of the full job
    full = await client.submit(PROMPT, model="alpha", max_tokens=8, temperature=0, timeout=60)
    assert full.ok and full.usage is not None and full.usage.completion_tokens == 8 and not full.cached
    assert full.degraded is None


async def test_the_deployment_defaults_for_interactive_jobs(harness, prefix, client):
    """alpha's settings give interactive jobs that name none a fallback
    (its own name and a model nobody serves are skipped) and a degraded
    max_tokens; a job's own fields win. (Batch jobs are never refused
    overloaded, so neither default ever applies to them.)"""
    alpha_engine = EchoEngine(model_name="alpha", stalled=True)
    alpha = await harness.start(
        alpha_engine,
        model_routes=True,
        admission=AdmissionConfig(max_queued_tokens=16),
        fallback_models=("alpha", "gamma", "beta"),
        degrade_max_tokens=2,
        drain_timeout=0.5,
    )
    beta = await harness.start(EchoEngine(model_name="beta"), model_routes=True, default_model="alpha")
    first = await client.publish({"prompt": PROMPT, "max_tokens": 3})
    await wait_until(lambda: alpha_engine.add_count[first] == 1, timeout=30)

    moved = await client.submit(PROMPT, max_tokens=5, timeout=60)
    assert moved.ok and (moved.served_model, moved.degraded) == ("beta", ["model"])
    assert moved.usage is not None and moved.usage.completion_tokens == 5

    short = await client.submit(PROMPT, max_tokens=2, fallback_models=["gamma"], timeout=60)
    assert short.error is not None and short.error.code == "overloaded"  # 2 is no degraded form of 2

    keys = {
        "default": await client.publish({"prompt": PROMPT, "max_tokens": 5, "fallback_models": ["gamma"]}),
        "own": await client.publish(
            {"prompt": PROMPT, "max_tokens": 5, "fallback_models": ["gamma"], "degrade": {"max_tokens": 1}}
        ),
    }
    await wait_until(lambda: all(alpha_engine.add_count[k] == 1 for k in keys.values()), timeout=30)
    alpha_engine.unstall()
    got = {name: await client.wait(key, timeout=60) for name, key in keys.items()}
    assert {name: (r.usage.completion_tokens, r.degraded) for name, r in got.items() if r.usage is not None} == {
        "default": (2, ["max_tokens"]),
        "own": (1, ["max_tokens"]),
    }
    assert alpha.stats["degraded_fallback"] == 1 and alpha.stats["degraded_max_tokens"] == 2
    assert beta.stats["done_ok"] == 1
