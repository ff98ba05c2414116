"""Per-tenant limits (``jaxserve worker --limits FILE``) and their two stores.

The file (YAML; this shape is the contract)::

    default: {requests_per_s: 50, burst: 100}
    tenants:
      acme: {requests_per_s: 1, burst: 5, tokens_per_min: 20000, max_in_flight: 8, cost_per_day: 25}

A job's tenant is its body's ``tenant`` (jobs without one count as the
tenant ``""``, under ``default``). Per tenant, every key optional:

* ``requests_per_s`` with ``burst``: a token bucket of requests;
* ``tokens_per_min``: a token bucket of ``burst`` = the per-minute amount,
  charged prompt + ``max_tokens`` at admission and corrected by the actual
  use when the job ends (unused tokens go back);
* ``max_in_flight``: jobs of the tenant running at once;
* ``cost_per_day``: a budget of money (the currency of the worker's
  prices, ``jaxserve.cost``), a bucket of ``burst`` = the daily amount
  that refills continuously over 24 h, charged and settled like
  ``tokens_per_min``: the cost of prompt + ``max_tokens`` at admission,
  the unspent part back when the job ends. Without prices the worker
  charges nothing and the budget never refuses.

A job that asks more than its tenant's whole ``tokens_per_min`` or
``cost_per_day`` could never be admitted, however long it waited: it is
refused for good (:func:`never_fits`; the worker answers it
``rate_limited``, not retryable, whatever its queue).

A tenant listed under ``tenants`` gets its own keys and falls back to
``default`` for the rest. :class:`MemoryLimiter` keeps the state in the
worker; :class:`RedisLimiter` shares it between every worker on one Redis
(atomic Lua scripts), so limits hold across a fleet. What happens to a job
over its limit is the worker's rule (interactive: ``rate_limited`` with
``retry_after_s``; batch: it waits, back in the broker), see
``jaxserve.worker.steps`` (``tenant_on_arrival``, ``tenant_tokens``) and
``JobRun.defer`` in ``jaxserve.worker.job_run``.

Limits apply to arrivals. A bucket is judged at the moment the job's
delivery was received (``at``, epoch seconds), not when the limiter happens
to be called: otherwise a slow store or a loaded machine between receipt and
the check spreads a burst of arrivals over seconds and lets the refill admit
it (``tests/test_queue_tenant_arrival.py``). A bucket only moves forward in
time: an arrival older than the last one it judged (calls reach it out of
order, or workers' clocks differ a little) adds no tokens. The worker asks in
two steps: :meth:`Limiter.arrive` (in flight, requests) before any store
look-up, :meth:`Limiter.charge` (tokens) once the prompt is tokenized; a job
that never runs gives its request back (:meth:`Limiter.release`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Protocol

_KEYS = ("requests_per_s", "burst", "tokens_per_min", "max_in_flight", "cost_per_day")
DAY_S = 86400.0


class LimitsFileError(ValueError):
    """The limits file does not have the documented shape."""


@dataclasses.dataclass(frozen=True)
class TenantLimit:
    requests_per_s: float | None = None
    burst: float | None = None
    tokens_per_min: float | None = None
    max_in_flight: int | None = None
    cost_per_day: float | None = None

    def merged(self, fallback: TenantLimit) -> TenantLimit:
        return TenantLimit(*(getattr(self, k) if getattr(self, k) is not None else getattr(fallback, k) for k in _KEYS))

    @property
    def request_burst(self) -> float:
        if self.requests_per_s is None:
            return math.inf
        return self.burst if self.burst is not None else max(1.0, self.requests_per_s)


@dataclasses.dataclass(frozen=True)
class LimitsConfig:
    default: TenantLimit = TenantLimit()
    tenants: dict[str, TenantLimit] = dataclasses.field(default_factory=dict)

    def for_tenant(self, tenant: str) -> TenantLimit:
        own = self.tenants.get(tenant)
        return self.default if own is None else own.merged(self.default)

    def metric_label(self, tenant: str) -> str:
        """Bounded label values: listed tenants by name, the rest as one."""
        return tenant if tenant in self.tenants else ("default" if not tenant else "other")


def _limit(where: str, raw: Any) -> TenantLimit:
    if raw is None:
        return TenantLimit()
    if not isinstance(raw, dict):
        raise LimitsFileError(f"{where} must be a mapping of {', '.join(_KEYS)}, got {raw!r}")
    unknown = set(raw) - set(_KEYS)
    if unknown:
        raise LimitsFileError(f"{where}: unknown keys {sorted(unknown)}; known: {', '.join(_KEYS)}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise LimitsFileError(f"{where}.{key} must be a positive number, got {value!r}")
        if key == "max_in_flight" and int(value) != value:
            raise LimitsFileError(f"{where}.max_in_flight must be an integer, got {value!r}")
        if key == "burst" and value < 1:  # a bucket that never holds one request admits none
            raise LimitsFileError(f"{where}.burst must be at least 1 (one request), got {value!r}")
        values[key] = int(value) if key == "max_in_flight" else float(value)
    return TenantLimit(**values)


def load_limits(path: str | Path) -> LimitsConfig:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise LimitsFileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"default", "tenants"}:
        raise LimitsFileError(
            f"{path}: expected the keys 'default' and 'tenants', got {sorted(data) if isinstance(data, dict) else data!r}"
        )
    tenants = data.get("tenants") or {}
    if not isinstance(tenants, dict):
        raise LimitsFileError(f"{path}: 'tenants' must map tenant names to limits")
    return LimitsConfig(
        default=_limit("default", data.get("default")),
        tenants={str(name): _limit(f"tenants.{name}", raw) for name, raw in tenants.items()},
    )


@dataclasses.dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""  # requests_per_s | tokens_per_min | max_in_flight | cost_per_day
    retry_after_s: float = 0.0
    # Set when the job asks more than the limit's whole bucket holds: no
    # wait ever admits it, so it is refused for good (``needed`` of ``limit``).
    never: bool = False
    needed: float = 0.0
    limit: float = 0.0


ALLOWED = Decision(True)


def never_fits(lim: TenantLimit, tokens: int, cost: float) -> Decision | None:
    """The refusal of a job larger than its tenant's whole tokens or cost
    bucket, else None. A token bucket refills up to its burst and no
    further, so such a job would wait forever, or, since the bucket's "how
    long until it fits" is 0 for it, slip through uncharged
    (``tests/test_limits_cost.py::test_a_job_larger_than_the_whole_budget_is_refused_for_good``).
    Judged before any bucket is touched, so the refusal takes nothing."""
    if lim.tokens_per_min is not None and tokens > lim.tokens_per_min:
        return Decision(False, "tokens_per_min", never=True, needed=float(tokens), limit=lim.tokens_per_min)
    if lim.cost_per_day is not None and cost > lim.cost_per_day:
        return Decision(False, "cost_per_day", never=True, needed=cost, limit=lim.cost_per_day)
    return None


class Limiter(Protocol):
    async def arrive(self, tenant: str, job: str, at: float) -> Decision:
        """Count one job of ``tenant`` that arrived at ``at`` (epoch seconds):
        it enters the tenant's in-flight set and takes one request, judged as
        of ``at``; or say which limit refuses it and for how long (then it
        holds nothing)."""

    async def charge(self, tenant: str, job: str, tokens: int, at: float, cost: float = 0.0) -> Decision:
        """Charge an arrived job its ``tokens`` (prompt + max_tokens) and
        their ``cost`` (the same tokens at the worker's price), judged as of
        its arrival ``at``. A refusal takes nothing; the caller then releases
        the job."""

    async def release(
        self, tenant: str, job: str, unused_tokens: int, *, unserved: bool = False, unused_cost: float = 0.0
    ) -> None:
        """The job ended: it leaves the in-flight set and gives back the
        tokens and the cost it was charged but did not use, and its request
        when it never ran (``unserved``: answered from the store, refused,
        requeued before the engine took it)."""

    async def renew(self, tenant: str, job: str) -> None: ...


class _Bucket:
    __slots__ = ("level", "stamp")

    def __init__(self, level: float, stamp: float) -> None:
        self.level = level
        self.stamp = stamp


class MemoryLimiter:
    """Limits kept in this worker (for one worker, or per worker)."""

    def __init__(self, config: LimitsConfig) -> None:
        self.config = config
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._in_flight: dict[str, set[str]] = {}

    def _take(self, name: tuple[str, str], rate: float, burst: float, cost: float, at: float) -> float:
        """Take ``cost`` from a bucket as of ``at``; 0 when taken, else the
        seconds until it would be there. An ``at`` before the bucket's last
        one refills nothing."""
        b = self._buckets.get(name)
        if b is None:
            b = self._buckets[name] = _Bucket(burst, at)
        if at > b.stamp:
            b.level = min(burst, b.level + (at - b.stamp) * rate)
            b.stamp = at
        if b.level >= cost:
            b.level -= cost
            return 0.0
        return (min(cost, burst) - b.level) / rate

    def _give(self, name: tuple[str, str], burst: float, amount: float) -> None:
        b = self._buckets.get(name)
        if b is not None:
            b.level = min(burst, b.level + amount)

    async def arrive(self, tenant: str, job: str, at: float) -> Decision:
        lim = self.config.for_tenant(tenant)
        running = self._in_flight.setdefault(tenant, set())
        if lim.max_in_flight is not None and job not in running and len(running) >= lim.max_in_flight:
            return Decision(False, "max_in_flight", 0.2)
        if lim.requests_per_s is not None:
            wait = self._take((tenant, "requests"), lim.requests_per_s, lim.request_burst, 1.0, at)
            if wait:
                return Decision(False, "requests_per_s", wait)
        running.add(job)
        return ALLOWED

    async def charge(self, tenant: str, job: str, tokens: int, at: float, cost: float = 0.0) -> Decision:
        lim = self.config.for_tenant(tenant)
        too_big = never_fits(lim, tokens, cost)
        if too_big is not None:
            return too_big
        if lim.tokens_per_min is not None:
            wait = self._take((tenant, "tokens"), lim.tokens_per_min / 60.0, lim.tokens_per_min, float(tokens), at)
            if wait:
                return Decision(False, "tokens_per_min", wait)
        if lim.cost_per_day is not None and cost > 0:
            wait = self._take((tenant, "cost"), lim.cost_per_day / DAY_S, lim.cost_per_day, float(cost), at)
            if wait:
                if lim.tokens_per_min is not None:  # a refusal takes nothing
                    self._give((tenant, "tokens"), lim.tokens_per_min, float(tokens))
                return Decision(False, "cost_per_day", wait)
        return ALLOWED

    async def release(
        self, tenant: str, job: str, unused_tokens: int, *, unserved: bool = False, unused_cost: float = 0.0
    ) -> None:
        self._in_flight.get(tenant, set()).discard(job)
        lim = self.config.for_tenant(tenant)
        if lim.tokens_per_min is not None and unused_tokens > 0:
            self._give((tenant, "tokens"), lim.tokens_per_min, float(unused_tokens))
        if lim.cost_per_day is not None and unused_cost > 0:
            self._give((tenant, "cost"), lim.cost_per_day, float(unused_cost))
        if unserved and lim.requests_per_s is not None:
            self._give((tenant, "requests"), lim.request_burst, 1.0)

    async def renew(self, tenant: str, job: str) -> None:
        pass


# KEYS[1] bucket; ARGV: rate/s, burst, cost, ttl ms, at (the arrival, epoch
# seconds). Returns {1, 0} when the cost was taken, else {0, seconds to
# wait}. The bucket is judged as of the arrival; it never moves back in
# time, so an arrival older than its stamp refills nothing.
_TAKE_LUA = """
local rate, burst, cost, at = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
local s = redis.call('HMGET', KEYS[1], 'level', 'stamp')
local level = tonumber(s[1]) or burst
local stamp = tonumber(s[2]) or at
if at > stamp then
  level = math.min(burst, level + (at - stamp) * rate)
  stamp = at
end
local ok = 0
local wait = 0
if level >= cost then
  level = level - cost
  ok = 1
else
  wait = (math.min(cost, burst) - level) / rate
end
redis.call('HSET', KEYS[1], 'level', string.format('%.17g', level), 'stamp', string.format('%.17g', stamp))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {ok, tostring(wait)}
"""
_GIVE_LUA = """
local s = redis.call('HMGET', KEYS[1], 'level')
if s[1] then
  redis.call('HSET', KEYS[1], 'level', string.format('%.17g', math.min(tonumber(ARGV[1]), tonumber(s[1]) + tonumber(ARGV[2]))))
end
return 0
"""
# KEYS[1] sorted set of in-flight jobs (score: expiry); ARGV: job, limit,
# lease s. Members whose lease ran out (a worker died) drop off. Leases run
# on the server's clock (they measure real time, not arrivals).
_ENTER_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  return 1
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.floor(tonumber(ARGV[3]) * 1000) + 1000)
return 1
"""


class RedisLimiter:
    """Limits shared by every worker on one Redis (``--store redis``)."""

    def __init__(self, config: LimitsConfig, redis: Any, *, namespace: str = "jaxserve", lease_s: float = 60.0) -> None:
        self.config = config
        self._r = redis
        self.ns = namespace
        self.lease_s = lease_s
        self._take = redis.register_script(_TAKE_LUA)
        self._give = redis.register_script(_GIVE_LUA)
        self._enter = redis.register_script(_ENTER_LUA)

    def _k(self, kind: str, tenant: str) -> str:
        return f"{self.ns}:limits:{kind}:{tenant}"

    async def _bucket(self, kind: str, tenant: str, rate: float, burst: float, cost: float, at: float) -> float:
        ttl_ms = int(max(60.0, burst / rate * 2) * 1000)
        ok, wait = await self._take(keys=[self._k(kind, tenant)], args=[rate, burst, cost, ttl_ms, repr(float(at))])
        return 0.0 if int(ok) else float(wait)

    async def arrive(self, tenant: str, job: str, at: float) -> Decision:
        lim = self.config.for_tenant(tenant)
        enter = self._k("inflight", tenant)
        if lim.max_in_flight is not None and not int(
            await self._enter(keys=[enter], args=[job, lim.max_in_flight, self.lease_s])
        ):
            return Decision(False, "max_in_flight", 0.2)
        if lim.requests_per_s is not None:
            wait = await self._bucket("requests", tenant, lim.requests_per_s, lim.request_burst, 1.0, at)
            if wait:
                await self._leave(tenant, job, lim)
                return Decision(False, "requests_per_s", wait)
        return ALLOWED

    async def charge(self, tenant: str, job: str, tokens: int, at: float, cost: float = 0.0) -> Decision:
        lim = self.config.for_tenant(tenant)
        too_big = never_fits(lim, tokens, cost)
        if too_big is not None:
            return too_big
        if lim.tokens_per_min is not None:
            wait = await self._bucket(
                "tokens", tenant, lim.tokens_per_min / 60.0, lim.tokens_per_min, float(tokens), at
            )
            if wait:
                return Decision(False, "tokens_per_min", wait)
        if lim.cost_per_day is not None and cost > 0:
            wait = await self._bucket("cost", tenant, lim.cost_per_day / DAY_S, lim.cost_per_day, float(cost), at)
            if wait:
                if lim.tokens_per_min is not None:  # a refusal takes nothing
                    await self._give(keys=[self._k("tokens", tenant)], args=[lim.tokens_per_min, float(tokens)])
                return Decision(False, "cost_per_day", wait)
        return ALLOWED

    async def _leave(self, tenant: str, job: str, lim: TenantLimit) -> None:
        if lim.max_in_flight is not None:
            await self._r.zrem(self._k("inflight", tenant), job)

    async def release(
        self, tenant: str, job: str, unused_tokens: int, *, unserved: bool = False, unused_cost: float = 0.0
    ) -> None:
        lim = self.config.for_tenant(tenant)
        await self._leave(tenant, job, lim)
        if lim.tokens_per_min is not None and unused_tokens > 0:
            await self._give(keys=[self._k("tokens", tenant)], args=[lim.tokens_per_min, float(unused_tokens)])
        if lim.cost_per_day is not None and unused_cost > 0:
            await self._give(keys=[self._k("cost", tenant)], args=[lim.cost_per_day, float(unused_cost)])
        if unserved and lim.requests_per_s is not None:
            await self._give(keys=[self._k("requests", tenant)], args=[lim.request_burst, 1.0])

    async def renew(self, tenant: str, job: str) -> None:
        lim = self.config.for_tenant(tenant)
        if lim.max_in_flight is not None:
            await self._enter(keys=[self._k("inflight", tenant)], args=[job, lim.max_in_flight, self.lease_s])
