"""What a worker serves under which names, and what a job that would be
answered ``overloaded`` gets instead when it asked for something else
(``docs/protocol.md``, "Routing by model" and "Fallbacks and
degraded answers").

Routes: :func:`model_routes` turns the worker's settings into the
:class:`~jaxserve.worker.routing.ModelRoutes` it declares and consumes (the
served name first, then each alias; the default model's worker keeps the
single-model queues). Only the served name and the configured aliases are
bound, never the engine's own model name: two workers of one preset under
two served names would otherwise both bind it, and a direct exchange would
give a job naming it to both.

Instead of ``overloaded``: the admission steps that answer ``overloaded``
(``steps.broker_wait``, ``steps.interactive_budget``) leave the refusal in
``Prepared.overload`` when :func:`may_degrade` says the job accepts
something else; the step ``steps.instead_of_overloaded`` then asks
:func:`degrade` here, which, in order,

1. re-routes the job, once, to the first of its ``fallback_models`` whose
   queue has a consumer and room (``routing.find_fallback``,
   ``routing.reroute``); the run then ends acked (``JobRun.rerouted``) and
   the fallback's worker answers it, ``served_model`` its name and
   ``degraded: ["model"]``;
2. else runs it with ``degrade.max_tokens`` (``degraded: ["max_tokens"]``);
3. else leaves the answer ``overloaded``, as for a job that asked nothing.

The deployment may give interactive jobs defaults for both
(``WorkerConfig.fallback_models``, ``degrade_max_tokens``; ``jaxserve
worker --fallback-model --degrade-max-tokens``); a job's own fields win,
and a batch job only ever gets what it asked for. A job with neither, on
a worker with no defaults, keeps today's path exactly: its step answers it
itself.
Tests: ``tests/test_queue_models.py``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from jaxserve.wire import INTERACTIVE, Result
from jaxserve.worker import routing
from jaxserve.worker.config import WorkerConfig

if TYPE_CHECKING:
    from jaxserve.worker.job_run import JobRun

log = structlog.get_logger("jaxserve.worker")

#: ``degraded`` entries (``jaxserve.wire.messages.Degradation``)
MODEL = "model"
MAX_TOKENS = "max_tokens"


async def model_routes(
    cfg: WorkerConfig,
    served: str | None,
    connection: Any = None,
    keep: Callable[[str, Any], None] | None = None,
) -> routing.ModelRoutes | None:
    """The routes a worker serving ``served`` declares and consumes; None
    when routing is off or the engine has no name to route by (it then
    consumes the single-model queues, as before routing). Whether it
    serves the default model is the broker's claim
    (``routing.claim_default``), read and, if nobody holds it, taken over
    ``connection``; ``keep(name, channel)`` keeps the claim's channel open
    (its consumer says this model runs). Without a connection (a worker
    that declares nothing) ``--default-model`` alone decides, unset
    meaning this worker."""
    if not cfg.model_routes or not served:
        return None
    names = tuple(dict.fromkeys((served, *cfg.model_aliases)))
    if connection is None:
        default = cfg.default_model is None or cfg.default_model in names
        name = cfg.default_model if cfg.default_model is not None else (served if default else None)
    else:
        claim = await routing.claim_default(cfg.amqp_url, connection, cfg.topology, names, explicit=cfg.default_model)
        default, name = claim.ours, claim.name
        if claim.alive is not None and keep is not None:
            keep("default-model", claim.alive)
        if not default:
            log.info("default_model_elsewhere", default_model=name, served=served)
    return routing.ModelRoutes(
        cfg.topology, served=served, aliases=tuple(cfg.model_aliases), default=default, default_model=name
    )


def default_model(routes: routing.ModelRoutes | None, cfg: WorkerConfig) -> str | None:
    """The name the deployment's default model answers to, for
    ``routing.find_fallback`` (a fallback that names it is found on the
    single-model queues)."""
    if routes is not None and routes.default_model is not None:
        return routes.default_model
    return cfg.default_model


def requested_model(run: JobRun) -> str | None:
    """The model the job is to be served as: the fallback a re-routed copy
    names (``routing.serve_as``), else the job's own ``model``."""
    return routing.serve_as(run.primary.message.headers) or run.job.model


def is_rerouted(run: JobRun) -> bool:
    return routing.was_rerouted(run.primary.message.headers)


def fallbacks(run: JobRun) -> tuple[str, ...]:
    """Where the job may be re-routed: its own ``fallback_models``, else,
    for an interactive job, the deployment's (``WorkerConfig.fallback_models``,
    less this worker's own names and the job's model); none for a copy
    that was re-routed once already."""
    if is_rerouted(run):
        return ()
    job, cfg = run.job, run.services.cfg
    if job.fallback_models or run.queue_class != INTERACTIVE:
        return job.fallback_models
    own = {run.services.engine.served_model_name, *cfg.model_aliases, job.model}
    return tuple(name for name in cfg.fallback_models if name not in own)


def degrade_limit(run: JobRun) -> int | None:
    """The smaller ``max_tokens`` the job accepts: its own ``degrade``,
    else, for an interactive job, the deployment's when it is smaller than
    the job's."""
    job, default = run.job, run.services.cfg.degrade_max_tokens
    if job.degrade_max_tokens is not None or run.queue_class != INTERACTIVE or default is None:
        return job.degrade_max_tokens
    return default if default < job.params.max_tokens else None


def may_degrade(run: JobRun) -> bool:
    """Whether the job accepts anything instead of ``overloaded``: a
    fallback it was not re-routed from already, or a smaller max_tokens."""
    return bool(fallbacks(run)) or degrade_limit(run) is not None


@dataclasses.dataclass(frozen=True)
class Overload:
    """An ``overloaded`` answer held back while its alternatives are tried."""

    reason: str  # the rejections metric's reason: broker_wait, interactive_token_budget
    result: Result


class Outcome(enum.Enum):
    REROUTED = "rerouted"  # passed on and acked: the run is over
    DEGRADED = "degraded"  # runs here, with smaller limits
    REFUSED = "refused"  # nothing it accepts is possible: answer overloaded


async def degrade(run: JobRun, prompt_tokens: int) -> Outcome:
    """A fallback with room, else ``degrade.max_tokens``, else refused."""
    if await _reroute(run):
        return Outcome.REROUTED
    limit = degrade_limit(run)
    if limit is None:
        return Outcome.REFUSED
    svc, job = run.services, run.job
    run.job = dataclasses.replace(job, params=dataclasses.replace(job.params, max_tokens=limit))
    run.cache_key = None  # the cache key was of the full max_tokens: this answer is not that one's
    run.degraded.append(MAX_TOKENS)
    if run.queue_class == INTERACTIVE:  # it runs over the budget, but later prompts still wait behind its
        svc.admission.admit(run.request_id, prompt_tokens)
        run.holdings.take("admission", lambda _end: svc.admission.release(run.request_id))
    count(run, MAX_TOKENS)
    log.info("job_degraded", key=run.key, reason=MAX_TOKENS, max_tokens=limit, asked=job.params.max_tokens)
    return Outcome.DEGRADED


async def _reroute(run: JobRun) -> bool:
    """Pass the job to its first fallback with room; False when none has
    room, the job was re-routed before, or the broker refused the copy."""
    svc, names = run.services, fallbacks(run)
    conn = svc.routing.control_connection()
    if not names or conn is None:
        return False
    routes = svc.routing.routes
    try:
        target = await routing.find_fallback(
            conn, svc.cfg.topology, names, run.queue_class, default_model=default_model(routes, svc.cfg)
        )
        if target is None:
            log.info("job_fallback_none_free", key=run.key, fallbacks=list(names))
            return False
        served = svc.engine.served_model_name
        from_model = "" if routes is None or routes.default else served
        await routing.reroute(conn, run.primary.message, target, from_model=from_model)
    except Exception as exc:  # noqa: BLE001 - RerouteError or a broker hiccup: answer as if none had room
        svc.stats["reroute_failed"] += 1
        log.warning("job_reroute_failed", key=run.key, error=repr(exc))
        return False
    count(run, "fallback")
    await run.rerouted(target.model)
    return True


def count(run: JobRun, reason: str) -> None:
    run.services.stats[f"degraded_{reason}"] += 1
    run.services.engine.metrics.degradation(run.queue_class, reason)


__all__ = ["MAX_TOKENS", "MODEL", "Outcome", "Overload", "degrade", "may_degrade", "model_routes", "requested_model"]
