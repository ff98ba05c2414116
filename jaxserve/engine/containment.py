"""Failure containment: a failed batched step fails only its culprit.

A step is a batch: one bad request could make the whole step raise (while
planning, filling the step's arrays, running the device programs or reading
their results), and every request in it would fail with it. An exception
while one request's token is detokenized fails that request alone
(``Engine._process_tokens``). Any other exception cannot be pinned on one
request of the batch, so :func:`recover`:

- drops the in-flight step and sends every request the failed work touched
  (the collected step's and the new plan's; everyone's when planning itself
  failed) back to waiting with its KV blocks freed, since their cache
  contents are not trusted, and with only the tokens already delivered to
  the caller: tokens the failed step produced are sampled again.
  Recomputation is exact: greedy tokens are a function of the tokens, and a
  seeded draw is ``fold_in(seed, output_index)``, as for preemption;
- marks those requests *suspects*. While there are suspects, each step runs
  the first of them alone (``step_modes.IsolatedStep``, planned by
  ``Scheduler.schedule_isolated``, not pipelined) until it has passed a step
  in which it sampled a token (it is cleared and rejoins the batch) or
  failed alone (it is finished with ``RequestOutput.error =
  RequestError('internal', ..., retryable=True)``). Other requests wait
  meanwhile.

So only the request that makes steps fail is failed, at the price of
recomputing the others once. A request that passes alone and later fails
again in a batch (a failure that depends on its progress) is isolated again:
each round it advances at least one token, so it ends. The one thing
recovery cannot repair is the device: when the failure deleted (donated) or
poisoned the KV cache buffers, ``Engine.step`` raises :class:`EngineBroken`
now and at every later call (:func:`raise_if_device_lost`). ``step`` also
re-raises a failure that touched no request at all.
Tests: ``tests/test_engine_containment.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import structlog

from jaxserve.engine.types import EngineBroken

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine

log = structlog.get_logger(__name__)


def recover(engine: Engine, exc: Exception) -> None:
    """Contain a failed batched step (see the module docstring)."""
    plans = list(engine._touched)
    if engine._in_flight is not None:
        plans.append(engine._in_flight[0])
        engine._in_flight = None
    raise_if_device_lost(engine, exc)
    involved = list(dict.fromkeys(s.request_id for plan in plans for s in plan.scheduled))
    if engine._planning:
        involved.extend(rid for rid in engine.scheduler.requests if rid not in involved)
    restore = [engine._requests[rid] for rid in involved if rid in engine._states]
    if not restore:
        raise exc
    policy = engine.scheduler_config.policy
    restore.sort(key=lambda r: r.sort_key(policy))
    try:
        # Worst first, so the best ends up at the front of its queue.
        for req in reversed(restore):
            engine.scheduler.reset_for_recompute(req, engine._states[req.request_id].num_tokens_seen)
    except Exception as recovery_exc:
        engine._broken = EngineBroken(
            f"recovering from a failed step ({exc!r}) failed: {recovery_exc!r}; the engine's state is lost"
        )
        raise engine._broken from recovery_exc
    for req in restore:
        engine._suspects[req.request_id] = None
    engine.num_failed_steps += 1
    log.warning(
        "engine.step_failed",
        error=repr(exc),
        suspects=[r.request_id for r in restore],
        exc_info=exc,
    )


def raise_if_device_lost(engine: Engine, exc: Exception) -> None:
    """Raise ``EngineBroken`` (from ``exc``) when the failure took the
    device state with it: a KV cache or weight buffer was deleted (a failing
    call that had it donated), or the cache holds a failed computation.
    Called with no step in flight."""
    lost = None
    arrays = jax.tree.leaves(engine.runner.kv_cache) + jax.tree.leaves(engine.runner.state)
    if any(a.is_deleted() for a in arrays if isinstance(a, jax.Array)):
        lost = "a KV cache or weight buffer was deleted"
    else:
        try:
            jax.block_until_ready(engine.runner.kv_cache)
        except Exception as cache_exc:  # noqa: BLE001
            lost = f"the KV cache holds a failed computation ({cache_exc!r})"
    if lost is not None:
        engine._broken = EngineBroken(f"engine step failed and {lost}: {exc!r}; restart the engine")
        raise engine._broken from exc
