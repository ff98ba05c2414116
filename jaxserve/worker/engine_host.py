"""The contract between the worker and whatever hosts its engine.

The worker never touches an engine: the engine is not thread-safe, and in
``--engine-process`` mode it is not even in the worker's process. It talks
to an *engine host* instead, and there are two of them:

- :class:`jaxserve.worker.engine_thread.EngineThread`: the engine on a
  thread of the worker's process;
- :class:`jaxserve.worker.engine_process.EngineProcess`: the engine in a
  process of its own, driven by the same thread there.

:class:`EngineHost` is what both offer, so the worker is written once:
requests go in as awaitables (``add_request``, ``add_score_request``,
``abort``, ``warmup``), outputs and errors come out through the callbacks
given to the host's constructor (``on_outputs``, ``on_step_error``,
``on_fatal`` and ``on_step_report``, all called on the event loop), and what
the worker needs to know about the engine is :class:`EngineInfo`, read once
after the engine is built. ``tests/test_engine_host_contract.py`` holds both
hosts, over every engine double of the tests, to the same checks.

:class:`HostedEngine` is the other side: what a host needs of an engine.
``jaxserve.engine.Engine`` has it, and so must every test double that stands
in for one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from jaxserve.engine.types import PriorOutput, RequestClass, RequestOutput
from jaxserve.sampling_params import SamplingParams

OutputsCallback = Callable[[list[RequestOutput]], None]
FailureCallback = Callable[[BaseException], None]


@dataclass(frozen=True)
class StepReport:
    """What ``on_step_report`` gets on the event loop, for the metrics: every
    output of one step (the interactive ones handed over before the step's
    end included) and the scheduler's snapshot after it (``None`` for an
    engine without a scheduler).

    A step that produced no output is not reported on its own: the next
    report's ``stats`` is the newer snapshot, and the metrics count from the
    snapshots' cumulative counters, so nothing is lost, and an idle-looking
    prefill does not wake the event loop once per step."""

    outputs: list[RequestOutput]
    stats: Any = None


StepReportCallback = Callable[[StepReport], None]


@dataclass(frozen=True)
class EngineInfo:
    """What the worker reads of an engine, once, after it is built: plain
    values (and the tokenizer, which the worker's process runs itself), so
    they can cross from the engine process. A field is ``None`` where the
    engine does not say."""

    model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    interactive_reserved_seqs: int | None = None
    vocab_size: int | None = None
    kv_cache_bytes: int | None = None
    #: how much KV cache the engine reserved, for what and why (one line; ``KVCacheSize.describe``)
    kv_cache_summary: str | None = None
    tokenizer: Any = None
    #: whether the engine has a scheduler whose snapshots feed the metrics
    has_scheduler: bool = False


def kv_cache_bytes(engine: Any) -> int | None:
    """The KV cache's size in bytes, where the engine tells it."""
    size = getattr(engine, "kv_cache_bytes", None)
    if size is None:
        size = getattr(getattr(getattr(engine, "runner", None), "kv_cache", None), "nbytes", None)
    return size if isinstance(size, int) else None


def _kv_cache_summary(engine: Any) -> str | None:
    describe = getattr(getattr(engine, "kv_cache_size", None), "describe", None)
    return describe() if callable(describe) else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def engine_info(engine: Any) -> EngineInfo:
    """:class:`EngineInfo` of an engine object, from whichever of the
    attributes it has (an engine double may have few)."""
    name = getattr(engine, "model_name", None)
    vocab = getattr(getattr(engine, "model_config", None), "vocab_size", None) or getattr(engine, "vocab_size", None)
    return EngineInfo(
        model_name=None if name is None else str(name),
        max_model_len=_int_or_none(getattr(engine, "max_model_len", None)),
        max_num_seqs=_int_or_none(getattr(engine, "max_num_seqs", None)),
        interactive_reserved_seqs=_int_or_none(getattr(engine, "interactive_reserved_seqs", None)),
        vocab_size=_int_or_none(vocab),
        kv_cache_bytes=kv_cache_bytes(engine),
        kv_cache_summary=_kv_cache_summary(engine),
        tokenizer=getattr(engine, "tokenizer", None),
        has_scheduler=callable(getattr(getattr(engine, "scheduler", None), "stats", None)),
    )


def scheduler_stats(engine: Any) -> Any:
    """The scheduler's snapshot of ``engine`` (on the engine's own thread),
    or ``None`` when it has no scheduler."""
    stats = getattr(getattr(engine, "scheduler", None), "stats", None)
    return stats() if callable(stats) else None


@runtime_checkable
class EngineHost(Protocol):
    """An engine host, as the worker uses it (see the module docstring).

    Lifecycle: construct it on the event loop, ``await open()`` (the engine
    is built, and :attr:`info` is set), ``await warmup()``, serve, then
    ``stop()`` (blocking: call it through ``asyncio.to_thread``). Once the
    host has died or stopped, every pending and later command fails with
    ``EngineThreadDead``; a death other than ``stop()`` is reported once
    through ``on_fatal`` and kept in :attr:`fatal_error`.
    """

    async def open(self) -> EngineInfo:
        """Build the engine where needed, start serving commands, and return
        :attr:`info`. Raises what the build raised."""
        ...

    @property
    def info(self) -> EngineInfo:
        """The engine's description; RuntimeError before :meth:`open`."""
        ...

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
    ) -> Awaitable[Any]:
        """Resolves once admitted; raises the engine's ``RequestError`` (its
        code kept) or ``EngineThreadDead``. ``deadline`` is a
        ``time.monotonic()`` value. ``prior``: output an earlier run of the
        request produced (``Engine.add_request``), for a job resumed from
        the tokens its dead worker saved."""
        ...

    def add_score_request(
        self,
        request_id: str,
        prompt: list[int],
        labels: list[list[int]],
        *,
        request_class: RequestClass = RequestClass.BATCH,
        priority: int = 0,
        deadline: float | None = None,
    ) -> Awaitable[Any]:
        """Label scoring, resolved as :meth:`add_request`."""
        ...

    def abort(self, request_id: str) -> Awaitable[Any]:
        """Resolves to whether the engine held the request."""
        ...

    def warmup(self) -> Awaitable[Any]:
        """Compile every shape bucket (may take minutes)."""
        ...

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop after the command or step in progress; blocking."""
        ...

    @property
    def alive(self) -> bool:
        """False once the host has stopped or died."""
        ...

    @property
    def pid(self) -> int | None:
        """The engine process's id; ``None`` for a host in this process."""
        ...

    @property
    def fatal_error(self) -> BaseException | None:
        """What ended the host, other than ``stop()``; ``None`` while it lives."""
        ...

    # The watchdog's clocks and the pacing counters (time.monotonic()).
    @property
    def busy_since_mono(self) -> float | None:
        """When the step or command now running started; ``None`` when idle."""
        ...

    @property
    def last_progress_mono(self) -> float:
        """When the last step or command completed."""
        ...

    @property
    def steps(self) -> int | None:
        """Steps completed."""
        ...

    @property
    def busy_s(self) -> float | None:
        """Seconds spent in steps."""
        ...

    @property
    def num_computed_tokens(self) -> int | None:
        """The engine's count of computed tokens; ``None`` if it keeps none."""
        ...


@runtime_checkable
class HostedEngine(Protocol):
    """What a host needs of an engine: commands and ``step()``, all called on
    the host's one thread. Optional hooks, set by the host where the engine
    has the attribute: ``before_plan`` (called inside ``step()`` just before
    it plans, to admit arrivals) and ``on_urgent_outputs`` (interactive
    outputs handed over before the step ends)."""

    def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> Any: ...

    def add_score_request(self, request_id: str, prompt: Any, labels: Any, **kwargs: Any) -> Any: ...

    def abort(self, request_id: str) -> Any: ...

    def warmup(self) -> Any: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...
