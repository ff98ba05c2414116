"""Admission, as an ordered list of steps (:data:`STEPS`).

Each step looks at one thing about a job before it may run; it returns True
to let the job go on, or answers it (``finish``), gives it back (``requeue``)
or defers it (``defer``) and returns False. A step that takes a resource
(the deadline timer, the claim, the tenant's count and tokens, the
interactive admission hold) registers it in the run's holdings, so the
run's ending gives it back whatever step ends it.

The order is part of the behaviour: the tenant's arrival is counted before
any store look-up (``tests/test_queue_tenant_arrival.py``); a stored result
or cancel wins over every limit; the claim comes before the prompt is
tokenized; a job's saved tokens are read once the key is its own (the
claim); the tokens limit and the interactive budget come last, once the
prompt's length is known (``tests/test_queue_admission.py``,
``tests/test_limits.py``). The last, :func:`instead_of_overloaded`, gives
a job that would be ``overloaded`` what it accepts instead (a fallback
model, a smaller ``max_tokens``; ``jaxserve.worker.fallback``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from jaxserve.cost.jobs import estimate
from jaxserve.engine.types import PriorOutput
from jaxserve.request_error import RequestError
from jaxserve.wire import INTERACTIVE, Result
from jaxserve.worker import prompts
from jaxserve.worker.fallback import MODEL, Outcome, Overload, degrade, is_rerouted, may_degrade, requested_model
from jaxserve.worker.holdings import Ending
from jaxserve.worker.lifecycle import JobState
from jaxserve.worker.limits import Limiter
from jaxserve.worker.progress import prior_output
from jaxserve.worker.results import timings
from jaxserve.worker.store import Record

if TYPE_CHECKING:
    from jaxserve.worker.job_run import JobRun

log = structlog.get_logger("jaxserve.worker")


@dataclasses.dataclass
class Prepared:
    """What the steps learn about a job on the way: its tokens."""

    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    label_ids: list[list[int]] | None = None
    calibration: Any = None  # the content-free label request, when the job calibrates
    overload: Overload | None = None  # an overloaded answer held back: the job accepts something else
    prior: PriorOutput | None = None  # tokens an earlier run saved: the job continues from them

    @property
    def num_tokens_to_prefill(self) -> int:
        """The prompt, and the saved tokens computed with it."""
        return len(self.prompt_ids) + (0 if self.prior is None else len(self.prior.token_ids))


Step = Callable[["JobRun", Prepared], Awaitable[bool]]


def reused(key: str) -> RequestError:
    return RequestError(
        "idempotency_key_reused",
        f"key {key!r} was already used for a different job body; use a new message_id for a new job",
    )


async def cancelled_here(run: JobRun, _p: Prepared) -> bool:
    """A cancel this worker saw (kept locally, so a store outage cannot lose it)."""
    if run.services.cancels.seen(run.key):
        await run.finish(Result.failure(run.key, "cancelled", "the job was cancelled"))
        return False
    return True


async def tenant_on_arrival(run: JobRun, _p: Prepared) -> bool:
    """The tenant's in-flight and request-rate limits, judged as of the
    job's arrival (``run.received_at``) and asked before any store look-up,
    so neither a slow store nor a loaded machine moves the moment a job is
    counted (``tests/test_queue_tenant_arrival.py``). Passing holds the
    tenant's count (no tokens charged yet); a job that then never runs
    gives its request back."""
    svc = run.services
    if svc.limiter is None:
        return True
    try:
        decision = await svc.limiter.arrive(run.job.tenant or "", run.request_id, run.received_at)
    except Exception as exc:  # noqa: BLE001 - a limiter outage must not stop serving: fail open
        svc.stats["limiter_unavailable"] += 1
        log.warning("limiter_unavailable", key=run.key, error=repr(exc))
        return True
    if not decision.allowed:
        await _over_limit(run, decision)
        return False
    run.tenant_tokens = 0
    limiter = svc.limiter
    run.holdings.take("tenant", lambda end: _release_tenant(run, limiter, end))
    return True


async def _release_tenant(run: JobRun, limiter: Limiter, end: Ending) -> None:
    """The job leaves its tenant's in-flight count and gives back the
    tokens and the budget it was charged but did not use."""
    unserved = run.admitted_mono is None  # never reached the engine: its request is given back
    try:
        await limiter.release(
            run.job.tenant or "",
            run.request_id,
            max(0, run.tenant_tokens - end.used_tokens),
            unserved=unserved,
            unused_cost=max(0.0, run.tenant_cost - end.used_cost),
        )
    except Exception as exc:  # noqa: BLE001
        log.warning("limiter_release_failed", key=run.key, error=repr(exc))


async def _over_limit(run: JobRun, decision: Any) -> None:
    """Interactive: answered rate_limited with retry_after_s; batch: it
    waits, back in the broker (``JobRun.defer``). A job larger than the
    whole limit (``decision.never``) is answered rate_limited, not
    retryable, in either queue: no wait would ever admit it."""
    tenant = run.job.tenant or ""
    count_rejection(run, "rate_limited", decision.reason)
    if decision.never:
        await run.finish(Result.failure(run.key, "rate_limited", _never_message(run, tenant, decision), False))
        return
    if run.queue_class == INTERACTIVE:
        await run.finish(
            Result.failure(
                run.key,
                "rate_limited",
                f"tenant {tenant!r} is over its {decision.reason} limit",
                retry_after_s=round(decision.retry_after_s, 3),
            )
        )
    else:
        await run.defer(decision.retry_after_s, decision.reason)


def _never_message(run: JobRun, tenant: str, decision: Any) -> str:
    if decision.reason == "cost_per_day":
        prices = run.services.cfg.prices
        currency = prices.currency if prices is not None else ""
        asked = f"may cost {decision.needed:.6g} {currency}".rstrip()
        whole = f"{decision.limit:g} {currency}".rstrip()
    else:
        asked, whole = f"needs {decision.needed:g} tokens", f"{decision.limit:g}"
    return (
        f"the job {asked} (prompt + max_tokens), more than tenant {tenant!r}'s whole "
        f"{decision.reason} of {whole}: it can never be admitted; lower max_tokens or shorten the prompt"
    )


def count_rejection(run: JobRun, code: str, reason: str) -> None:
    svc = run.services
    svc.stats[f"rejected_{code}"] += 1
    label = svc.cfg.limits.metric_label(run.job.tenant or "") if svc.cfg.limits is not None else "default"
    svc.engine.metrics.rejection(code, reason, run.queue_class, label)


async def stored_result(run: JobRun, _p: Prepared) -> bool:
    """A key answered before (here or by another worker) is replayed."""
    rec = await run.store_call(run.services.store.get, run.key)
    if rec is None:
        return True
    await answer_from_record(run, rec)
    return False


async def answer_from_record(run: JobRun, rec: Record) -> None:
    if rec.fingerprint is not None and rec.fingerprint != run.job.fingerprint:
        run.services.stats["key_reused"] += 1
        await run.finish(Result.failure(run.key, "idempotency_key_reused", reused(run.key).message))
        return
    run.services.stats["replayed"] += 1
    await run.finish(Result.model_validate(rec.result), record=rec)


async def cancelled_in_store(run: JobRun, _p: Prepared) -> bool:
    if await run.store_call(run.services.store.is_cancelled, run.key):
        await run.finish(Result.failure(run.key, "cancelled", "the job was cancelled"))
        return False
    return True


async def deadline(run: JobRun, _p: Prepared) -> bool:
    """A job past its deadline is answered expired; one with a deadline
    holds a timer that expires it while it has no first token."""
    job = run.job
    if job.deadline is None:
        return True
    if time.time() >= job.deadline:
        await run.finish(Result.failure(run.key, "expired", "the job's deadline passed before it started"))
        return False
    handle = asyncio.get_running_loop().call_later(max(0.0, job.deadline - time.time()), run.on_deadline)
    run.holdings.take("deadline", lambda _end: handle.cancel())
    return True


async def claim(run: JobRun, _p: Prepared) -> bool:
    """Claim the key (a shared store: never started on two workers at
    once); while another worker holds it the job is HELD, and answered from
    the store once that worker stored a result."""
    svc, key = run.services, run.key
    while True:
        owner = await run.store_call(svc.store.claim, key, svc.cfg.worker_id, svc.cfg.claim_lease_s)
        if owner is None:
            break
        svc.stats["held_for_other_worker"] += 1
        log.info("job_held_claimed_elsewhere", key=key, owner=owner)
        run.to(JobState.HELD)
        await asyncio.sleep(svc.cfg.claim_poll_s)
        if run.state is not JobState.HELD:
            return False
        run.to(JobState.ADMITTING)
        rec = await run.store_call(svc.store.get, key)
        if rec is not None:
            await answer_from_record(run, rec)
            return False

    async def release(end: Ending) -> None:
        if not end.ok:  # an ok result's store put ends the claim itself
            await svc.store_health.best_effort("release", svc.store.release, key, svc.cfg.worker_id, stats=svc.stats)

    run.holdings.take("claim", release)
    return True


async def prompt(run: JobRun, p: Prepared) -> bool:
    """The prompt (and labels) as token ids; a prompt the model cannot take is answered."""
    svc, job = run.services, run.job
    info, served = svc.engine.info, svc.engine.served_model_name
    try:
        model = requested_model(run)  # a re-routed copy is served as the fallback it names
        p.prompt_ids = prompts.prepare_prompt(info, served, job, svc.cfg.model_aliases, model)
        if job.labels is not None:
            p.prompt_ids, p.label_ids, p.calibration = prompts.prepare_labels(info, job, served)
    except RequestError as err:
        svc.stats["invalid"] += 1
        log.info("job_invalid", key=run.key, code=err.code, reason=err.message)
        await run.finish(Result.failure(run.key, err.code, err.message, err.retryable))
        return False
    run.label_ids = p.label_ids
    if is_rerouted(run) and MODEL not in run.degraded:
        run.degraded.append(MODEL)
    return True


async def cached_result(run: JobRun, p: Prepared) -> bool:
    """A deterministic job whose result is cached is answered from the cache."""
    svc, job = run.services, run.job
    if not (job.deterministic and job.use_cache):
        return True
    run.cache_key = prompts.cache_key(svc.engine.served_model_name, job, p.prompt_ids, p.label_ids, p.calibration)
    hit = await run.store_call(svc.store.cache_get, run.cache_key)
    if hit is None:
        return True
    svc.stats["cache_hits"] += 1
    log.info("job_cache_hit", key=run.key, queue=run.queue_class)
    fresh = {"id": run.key, "cached": True, "timings": timings(run), "trace_id": None, "degraded": run.degraded or None}
    cached = Result.model_validate({**hit, **fresh})
    await run.finish(cached)
    return False


async def saved_tokens(run: JobRun, p: Prepared) -> bool:
    """A job whose earlier run died mid-generation (its worker was killed)
    continues from the tokens that run saved (``jaxserve.worker.progress``):
    those written for this very body by this model, read once the key is
    ours (the claim) and the prompt known."""
    svc = run.services
    if p.label_ids is not None or not svc.saver.enabled:
        return True
    params = run.job.params
    chunks = await run.store_call(svc.store.saved_tokens, run.key)
    p.prior = prior_output(
        chunks,
        run.job.fingerprint,
        svc.engine.served_model_name,
        logprobs=params.logprobs,
        top=params.logprobs and params.top_logprobs > 0,
    )
    if p.prior is not None:
        svc.stats["resumed"] += 1
    return True


async def calibrate(run: JobRun, p: Prepared) -> bool:
    """The job's content-free label scores (``worker.label_calibrations``:
    computed once per label set, form and template); the job is answered
    when the engine refuses the content-free input, requeued when the
    engine is gone."""
    if p.calibration is None:
        return True
    try:
        run.label_calibration = await run.services.calibrations.get(
            p.calibration, run.request_class, run.job.engine_priority
        )
    except RequestError as err:
        if err.retryable:
            await run.requeue(f"label calibration: {err.message}")
        else:
            await run.finish(Result.failure(run.key, err.code, f"label calibration: {err.message}", err.retryable))
        return False
    except Exception as exc:  # noqa: BLE001 - the engine thread is gone
        await run.requeue(f"engine unavailable: {exc!r}")
        return False
    return True


async def tenant_tokens(run: JobRun, p: Prepared) -> bool:
    """The tenant's tokens limit and daily budget, charged as of the job's
    arrival: prompt + ``max_tokens``, and what they cost at the served
    model's price (``jaxserve.cost.jobs``; ``tests/test_queue_cost.py``)."""
    svc = run.services
    if svc.limiter is None or not run.holdings.holds("tenant"):  # counted on arrival: now its tokens
        return True
    job = run.job
    tokens = len(p.prompt_ids) + (max(len(x) for x in p.label_ids) if p.label_ids else job.params.max_tokens)
    if p.label_ids:  # scored labels are prompt tokens in usage (docs/protocol.md, label scoring)
        priced = (len(p.prompt_ids) + sum(len(x) for x in p.label_ids), 0)
    else:
        priced = (len(p.prompt_ids), job.params.max_tokens)
    cost = estimate(svc.cfg.prices, svc.engine.served_model_name, *priced)
    try:
        decision = await svc.limiter.charge(job.tenant or "", run.request_id, tokens, run.received_at, cost=cost)
    except Exception as exc:  # noqa: BLE001 - a limiter outage must not stop serving: fail open
        svc.stats["limiter_unavailable"] += 1
        log.warning("limiter_unavailable", key=run.key, error=repr(exc))
        return True
    if not decision.allowed:
        await _over_limit(run, decision)
        return False
    run.tenant_tokens = tokens
    run.tenant_cost = cost
    return True


async def broker_wait(run: JobRun, p: Prepared) -> bool:
    """An interactive job that already waited in the broker longer than the
    target time to first token could not start in time: the worker (or
    fleet) is behind, and the producer should know now, not after more
    waiting."""
    if run.queue_class != INTERACTIVE:
        return True
    waited = run.broker_wait_s
    target = run.services.cfg.admission.target_ttft_s
    if waited is None or waited <= target:
        return True
    return await _overloaded(
        run,
        p,
        "broker_wait",
        Result.failure(
            run.key,
            "overloaded",
            f"the job waited {waited:.2f}s in the broker, over the {target:g}s target time to first token; retry later",
            retry_after_s=round(min(waited, 30.0), 3),
        ),
    )


async def interactive_budget(run: JobRun, p: Prepared) -> bool:
    """An interactive job's prompt joins the admission budget
    (``jaxserve.worker.admission``) until its first token, or is refused
    overloaded with retry_after_s."""
    admission = run.services.admission
    if run.queue_class != INTERACTIVE or p.overload is not None:
        return True
    retry = admission.try_admit(run.request_id, p.num_tokens_to_prefill)
    if retry is not None:
        return await _overloaded(
            run,
            p,
            "interactive_token_budget",
            Result.failure(
                run.key,
                "overloaded",
                f"the worker holds {admission.held_tokens} interactive prompt tokens not yet started "
                f"(budget {admission.budget}); retry later",
                retry_after_s=retry,
            ),
        )
    run.holdings.take("admission", lambda _end: admission.release(run.request_id))
    return True


async def _overloaded(run: JobRun, p: Prepared, reason: str, result: Result) -> bool:
    """Answer ``overloaded``, unless the job accepts something else
    (``fallback_models``, ``degrade``): then the answer waits in
    ``p.overload`` for :func:`instead_of_overloaded` and the job goes on."""
    if may_degrade(run):
        p.overload = Overload(reason, result)
        return True
    count_rejection(run, "overloaded", reason)
    await run.finish(result)
    return False


async def instead_of_overloaded(run: JobRun, p: Prepared) -> bool:
    """A job that would be ``overloaded`` and accepts something else is
    re-routed to a fallback with room, or runs with its degraded limits, or
    is answered ``overloaded`` after all (``jaxserve.worker.fallback``;
    ``tests/test_queue_models.py``)."""
    if p.overload is None:
        return True
    outcome = await degrade(run, p.num_tokens_to_prefill)
    if outcome is Outcome.DEGRADED:
        return True
    if outcome is Outcome.REFUSED:
        count_rejection(run, "overloaded", p.overload.reason)
        await run.finish(p.overload.result)
    return False


STEPS: tuple[Step, ...] = (
    cancelled_here,
    tenant_on_arrival,
    stored_result,
    cancelled_in_store,
    deadline,
    claim,
    prompt,
    cached_result,
    saved_tokens,
    calibrate,
    tenant_tokens,
    broker_wait,
    interactive_budget,
    instead_of_overloaded,
)
