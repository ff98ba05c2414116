"""Failure containment: a failed batched step fails only its culprit.

A step is a batch: one bad request could make the whole step raise (while
planning, filling the step's arrays, running the device programs or reading
their results), and every request in it would fail with it. An exception
while one request's token is detokenized fails that request alone
(``Engine._process_tokens``). Any other exception cannot be pinned on one
request of the batch, so :meth:`Containment.recover`:

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
now and at every later call (:meth:`Containment.raise_if_device_lost`).
``step`` also re-raises a failure that touched no request at all.

:class:`Containment` keeps the books (the suspects, the plans the batched
step in progress has touched, whether the scheduler is planning, the lost
state); the engine owns one, the step modes drive it. What it needs of the
engine is :class:`Recoverable`.
Tests: ``tests/test_engine_containment.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import jax
import structlog

from jaxserve.engine.types import EngineBroken

if TYPE_CHECKING:
    from jaxserve.engine.request import Request
    from jaxserve.engine.runner import ModelRunner
    from jaxserve.engine.scheduler import Scheduler
    from jaxserve.engine.scheduler_output import SchedulerOutput

log = structlog.get_logger(__name__)


class Recoverable(Protocol):
    """What recovery needs of the engine."""

    scheduler: Scheduler
    runner: ModelRunner

    def recomputable(self, request_ids: list[str]) -> list[tuple[Request, int]]:
        """Those of ``request_ids`` the engine still serves, each with how
        many of its output tokens the caller has received."""
        ...


class Containment:
    """The books of failure containment (see the module docstring)."""

    def __init__(self) -> None:
        #: requests of a failed step, in service order, each to be run alone
        #: until it passes a sampling step
        self.suspects: dict[str, None] = {}
        self.touched: list[SchedulerOutput] = []  # plans the batched step in progress has used
        self.planning = False  # the scheduler is planning (a failure there touches everyone)
        self.broken: EngineBroken | None = None
        self.num_failed_steps = 0  # batched steps that failed and were contained
        self.num_isolated_steps = 0  # steps run for one suspect alone

    def check(self) -> None:
        """Raise :class:`EngineBroken` once the engine's state is lost."""
        if self.broken is not None:
            raise EngineBroken(str(self.broken)) from self.broken

    def next_suspect(self) -> str | None:
        """The suspect to run alone next, if any."""
        return next(iter(self.suspects), None)

    def clear(self, request_id: str) -> None:
        """``request_id`` is no suspect (any more): it passed a step alone,
        or it ended."""
        self.suspects.pop(request_id, None)

    def keep_suspects(self, schedulable: Callable[[str], bool]) -> None:
        """Drop the suspects that cannot run now (they ended meanwhile:
        aborted, expired; or they are parked)."""
        for request_id in [rid for rid in self.suspects if not schedulable(rid)]:
            del self.suspects[request_id]

    def begin(self, in_flight_plan: SchedulerOutput | None) -> None:
        """A batched step starts, the plan in flight (if any) its first touched one."""
        self.touched = [] if in_flight_plan is None else [in_flight_plan]

    def end(self) -> None:
        """The batched step is over, passed or contained."""
        self.touched = []
        self.planning = False

    def plan(self, schedule: Callable[[], SchedulerOutput]) -> SchedulerOutput:
        """``schedule()``'s plan, recorded as touched by the batched step in
        progress; a failure inside it touches every request."""
        self.planning = True
        plan = schedule()
        self.planning = False
        self.touched.append(plan)
        return plan

    def recover(self, engine: Recoverable, exc: Exception) -> None:
        """Contain a failed batched step (see the module docstring); the
        step in flight, if any, is dropped by the caller."""
        self.raise_if_device_lost(engine.runner, exc)
        involved = list(dict.fromkeys(s.request_id for plan in self.touched for s in plan.scheduled))
        if self.planning:
            involved.extend(rid for rid in engine.scheduler.requests if rid not in involved)
        restore = engine.recomputable(involved)
        if not restore:
            raise exc
        policy = engine.scheduler.config.policy
        restore.sort(key=lambda pair: pair[0].sort_key(policy))
        try:
            # Worst first, so the best ends up at the front of its queue.
            for req, delivered in reversed(restore):
                engine.scheduler.reset_for_recompute(req, delivered)
        except Exception as recovery_exc:
            self.broken = EngineBroken(
                f"recovering from a failed step ({exc!r}) failed: {recovery_exc!r}; the engine's state is lost"
            )
            raise self.broken from recovery_exc
        for req, _ in restore:
            self.suspects[req.request_id] = None
        self.num_failed_steps += 1
        log.warning(
            "engine.step_failed",
            error=repr(exc),
            suspects=[req.request_id for req, _ in restore],
            exc_info=exc,
        )

    def raise_if_device_lost(self, runner: ModelRunner, exc: Exception) -> None:
        """Raise ``EngineBroken`` (from ``exc``) when the failure took the
        device state with it: a KV cache or weight buffer was deleted (a failing
        call that had it donated), or the cache holds a failed computation."""
        lost = None
        arrays = jax.tree.leaves(runner.kv_cache) + jax.tree.leaves(runner.state)
        if any(a.is_deleted() for a in arrays if isinstance(a, jax.Array)):
            lost = "a KV cache or weight buffer was deleted"
        else:
            try:
                jax.block_until_ready(runner.kv_cache)
            except Exception as cache_exc:  # noqa: BLE001
                lost = f"the KV cache holds a failed computation ({cache_exc!r})"
        if lost is not None:
            self.broken = EngineBroken(f"engine step failed and {lost}: {exc!r}; restart the engine")
            raise self.broken from exc
