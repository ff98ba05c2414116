"""How one ``Engine.step`` runs: schedule, run, process, in one of four modes.

Every mode composes the engine's step parts (:class:`StepParts`): it plans
with the scheduler and launches the plan on the device (``schedule``,
``launch``), collects the sampled tokens of the step in flight
(``collect``) and processes them into outputs (``process``); the modes
differ in the order of those calls, i.e. in what the host does while the
device computes. A mode takes the step in flight (:class:`InFlight`, or
None) and returns its outputs with the step it leaves in flight, which
``Engine.step`` hands to the next call; modes hold no other state.
:func:`choose` picks the mode of each step:

- :class:`IsolatedStep` while failed work is being recomputed (suspects, see
  :mod:`jaxserve.engine.containment`): one request alone, not pipelined, so
  that a failure anywhere in it is this request's.
- :class:`OverlappedStep` with ``async_scheduling`` when the in-flight
  step's tokens stay on the device (all-greedy steps): the next step is
  launched before the host waits for them (vLLM's async scheduling). Not
  when a row of it is likely to carry guessed tokens next (speculative
  decoding, ``Engine.wants_drafts``): guesses follow a row's last token,
  which must be known when the step is planned.
- :class:`InteractiveFirstStep` when the caller takes urgent outputs
  (``Engine.on_urgent_outputs``, the worker): interactive tokens are
  processed and handed over before the next step is planned, and a step that
  is an interactive prompt's own is waited for at once.
- :class:`PipelinedStep` otherwise: collect the step in flight, plan and
  launch the next, then detokenize the collected tokens while the device
  runs the new step.

The batched modes contain their failures (``Containment.recover``). Tests:
``tests/test_engine.py``, ``tests/test_engine_containment.py``,
``tests/test_engine_thread.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from jaxserve.engine.containment import Containment, Recoverable
from jaxserve.engine.in_flight import Collected, InFlight, Pending
from jaxserve.engine.types import RequestOutput

if TYPE_CHECKING:
    from jaxserve.engine.scheduler_output import SchedulerOutput

#: a mode's result: its outputs, and the step it leaves in flight
Stepped = tuple[list[RequestOutput], InFlight | None]


class StepParts(Recoverable, Protocol):
    """The parts of a step that the modes compose (``Engine`` has them)."""

    containment: Containment
    async_scheduling: bool
    on_urgent_outputs: Callable[[list[RequestOutput]], None] | None

    def schedule(self) -> SchedulerOutput:
        """Plan the next batched step."""
        ...

    def launch(self, plan: SchedulerOutput, prev: InFlight | None = None) -> InFlight:
        """Launch a plan on the device (``prev``: the step whose pending
        tokens it reads there)."""
        ...

    def hold_pending(self, in_flight: InFlight) -> Pending:
        """Let the scheduler take the step's tokens as placeholders."""
        ...

    def collect(self, in_flight: InFlight, pending: Pending | None = None) -> Collected:
        """Wait for the step's tokens and apply them."""
        ...

    def process(self, collected: Collected) -> list[RequestOutput]:
        """Outputs of a collected step, finished scoring jobs first."""
        ...

    def process_tokens(self, collected: Collected) -> list[RequestOutput]:
        """Outputs of the collected tokens only."""
        ...

    def fail_request(self, request_id: str, exc: Exception) -> RequestOutput | None:
        """End a request whose own work raised."""
        ...

    def is_urgent(self, request_id: str) -> bool:
        """An interactive request, not a member of a scoring job."""
        ...

    def awaits_first_token(self, request_id: str) -> bool:
        """The request has produced no token yet."""
        ...

    def wants_drafts(self, in_flight: InFlight) -> bool:
        """A row of the in-flight step is likely to carry guessed tokens next."""
        ...


def _next_step(parts: StepParts, prev: InFlight | None = None) -> InFlight | None:
    """Plan the next step and launch it (None: nothing to run)."""
    plan = parts.schedule()
    return None if plan.is_empty else parts.launch(plan, prev)


class StepMode:
    """One way to run a step."""

    def run(self, parts: StepParts, in_flight: InFlight | None) -> Stepped:
        raise NotImplementedError


class IsolatedStep(StepMode):
    """One step of a suspect alone, not pipelined (failure containment): a
    failure anywhere in it is this request's; a step in which it sampled a
    token (or a scoring member's step, which samples none) clears it. No
    step is in flight while there are suspects (recovery dropped it)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def run(self, parts: StepParts, in_flight: InFlight | None) -> Stepped:
        request_id = self.request_id
        books = parts.containment
        books.num_isolated_steps += 1
        try:
            plan = parts.scheduler.schedule_isolated(request_id)
            outputs = parts.process(parts.collect(parts.launch(plan)))
        except Exception as exc:  # noqa: BLE001 - it failed alone: it is the culprit
            books.raise_if_device_lost(parts.runner, exc)
            failed = parts.fail_request(request_id, exc)
            return ([] if failed is None else [failed]), None
        req = parts.scheduler.get_request(request_id)
        if plan.scheduled[0].sample or req is None or not req.samples:
            books.clear(request_id)  # passed a whole step alone
        return outputs, None


class BatchedStep(StepMode):
    """A step of the whole batch, its failures contained: any exception
    while collecting, planning or launching cannot be pinned on one request,
    so ``Containment.recover`` sends every request it touched back to be
    recomputed, the step in flight is dropped, and the step returns
    nothing."""

    def run(self, parts: StepParts, in_flight: InFlight | None) -> Stepped:
        books = parts.containment
        books.begin(None if in_flight is None else in_flight.plan)
        try:
            collected, extra, launched = self.advance(parts, in_flight)
        except Exception as exc:  # noqa: BLE001 - contained, see Engine.step
            books.recover(parts, exc)
            return [], None
        finally:
            books.end()
        outputs = [] if collected is None else parts.process(collected)
        if extra is not None:
            outputs.extend(parts.process_tokens(extra))
        return outputs, launched

    def advance(
        self, parts: StepParts, in_flight: InFlight | None
    ) -> tuple[Collected | None, Collected | None, InFlight | None]:
        """Collect the step in flight and launch the next; returns what was
        collected (None: nothing was in flight), tokens collected later in
        the call to process after it (or None), and the step now in
        flight."""
        raise NotImplementedError


class PipelinedStep(BatchedStep):
    """Collect, plan and launch, then process while the device computes."""

    def advance(
        self, parts: StepParts, in_flight: InFlight | None
    ) -> tuple[Collected | None, Collected | None, InFlight | None]:
        collected = None if in_flight is None else parts.collect(in_flight)
        return collected, None, _next_step(parts)


class InteractiveFirstStep(BatchedStep):
    """``PipelinedStep`` with interactive outputs handed over first
    (``Engine.on_urgent_outputs``): the collected tokens of interactive
    requests are processed before the next step is planned, and when the
    step just launched is an interactive prompt's own (the scheduler gives
    one to a starting interactive prompt), it is waited for at once and its
    first tokens handed over in this call, before the batch rows collected
    earlier are processed."""

    def advance(
        self, parts: StepParts, in_flight: InFlight | None
    ) -> tuple[Collected | None, Collected | None, InFlight | None]:
        collected = None if in_flight is None else self._emit_urgent(parts, parts.collect(in_flight))
        launched = _next_step(parts)
        extra = None
        if launched is not None and self._first_tokens(parts, launched):
            more = self._emit_urgent(parts, parts.collect(launched))
            launched = _next_step(parts)
            if more.sampled:
                extra = more
        return collected, extra, launched

    @staticmethod
    def _first_tokens(parts: StepParts, launched: InFlight) -> bool:
        """Whether the launched step holds interactive requests only (no
        scoring job's members), one of them about to sample its first
        token."""
        rows = launched.plan.scheduled
        return all(parts.is_urgent(s.request_id) for s in rows) and any(
            s.sample and parts.awaits_first_token(s.request_id) for s in rows
        )

    @staticmethod
    def _emit_urgent(parts: StepParts, collected: Collected) -> Collected:
        """Process the collected tokens of interactive requests now and hand
        their outputs to ``on_urgent_outputs``; returns the rest of the
        collected step, to process after the next launch. Members of a
        scoring job are never urgent (their outputs are the job's)."""
        urgent, rest = collected.split(parts.is_urgent)
        if not urgent.sampled:
            return collected
        outputs = parts.process_tokens(urgent)
        if outputs and parts.on_urgent_outputs is not None:
            parts.on_urgent_outputs(outputs)
        return rest


class OverlappedStep(BatchedStep):
    """The next step launched *before* waiting for the in-flight one
    (vLLM's async scheduling).

    The in-flight step's sampled tokens enter the scheduler as pending
    placeholders; the next step is planned and launched at once, reading
    those tokens on the device; only then does the host wait, fill the
    placeholders in, and end requests that hit a stop id (they already hold
    a row in the launched step, whose token for them is dropped, as for stop
    strings). The device so never idles while the host plans. Used when the
    in-flight step's tokens came from the forward program's greedy pick
    (``InFlight.feedable``)."""

    def advance(
        self, parts: StepParts, in_flight: InFlight | None
    ) -> tuple[Collected | None, Collected | None, InFlight | None]:
        assert in_flight is not None  # choose() checked
        pending = parts.hold_pending(in_flight)
        launched = _next_step(parts, prev=in_flight)
        return parts.collect(in_flight, pending), None, launched


_PIPELINED = PipelinedStep()
_INTERACTIVE_FIRST = InteractiveFirstStep()
_OVERLAPPED = OverlappedStep()


def choose(parts: StepParts, in_flight: InFlight | None) -> StepMode:
    """The mode of the next step (see the module docstring)."""
    suspect = parts.containment.next_suspect()
    if suspect is not None:
        return IsolatedStep(suspect)
    if parts.async_scheduling and in_flight is not None and in_flight.feedable and not parts.wants_drafts(in_flight):
        return _OVERLAPPED
    if parts.on_urgent_outputs is not None:
        return _INTERACTIVE_FIRST
    return _PIPELINED
