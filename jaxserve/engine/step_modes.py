"""How one ``Engine.step`` runs: schedule, run, process, in one of four modes.

Every mode plans with the scheduler, runs the plan on the device
(``Engine._launch``), collects the sampled tokens (``Engine._collect``) and
processes them into outputs (``Engine._process``); they differ in the order
of those calls, i.e. in what the host does while the device computes.
:func:`choose` picks the mode of each step:

- :class:`IsolatedStep` while failed work is being recomputed (suspects, see
  :mod:`jaxserve.engine.containment`): one request alone, not pipelined, so
  that a failure anywhere in it is this request's.
- :class:`OverlappedStep` with ``async_scheduling`` when the in-flight
  step's tokens stay on the device (all-greedy steps): the next step is
  launched before the host waits for them (vLLM's async scheduling).
- :class:`InteractiveFirstStep` when the caller takes urgent outputs
  (``Engine.on_urgent_outputs``, the worker): interactive tokens are
  processed and handed over before the next step is planned, and a step that
  is an interactive prompt's own is waited for at once.
- :class:`PipelinedStep` otherwise: collect the step in flight, plan and
  launch the next, then detokenize the collected tokens while the device
  runs the new step.

The batched modes contain their failures (``containment.recover``). The
modes are the engine's own parts and use its private step primitives; they
hold no state between steps (tests: ``tests/test_engine.py``,
``tests/test_engine_containment.py``, ``tests/test_engine_thread.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import jax
import numpy as np

from jaxserve.engine.containment import raise_if_device_lost, recover
from jaxserve.engine.request import PENDING_TOKEN
from jaxserve.engine.types import RequestClass, RequestOutput

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine

#: a collected step: sampled token and its log-probability by request, and
#: the requests the scheduler finished by length
Collected = tuple[dict[str, int], dict[str, float], set[str]]


def by_request(
    request_ids: list[str], tokens: np.ndarray, logprobs: np.ndarray
) -> tuple[dict[str, int], dict[str, float]]:
    """A step's sampled tokens and log-probabilities keyed by request, in
    the order the plan's sampling requests were given (``tolist`` makes the
    Python numbers in one call: ``int()`` per numpy scalar took ~5% of the
    engine thread's samples in a 64-sequence offline run, py-spy)."""
    sampled = dict(zip(request_ids, np.asarray(tokens).tolist()))
    return sampled, dict(zip(request_ids, np.asarray(logprobs).tolist()))


class StepMode:
    """One way to run a step."""

    def run(self, engine: Engine) -> list[RequestOutput]:
        raise NotImplementedError


class IsolatedStep(StepMode):
    """One step of a suspect alone, not pipelined (``Engine.step``'s
    failure containment): a failure anywhere in it is this request's; a step
    in which it sampled a token (or a scoring member's step, which samples
    none) clears it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def run(self, engine: Engine) -> list[RequestOutput]:
        request_id = self.request_id
        engine.num_isolated_steps += 1
        try:
            plan = engine.scheduler.schedule_isolated(request_id)
            engine._launch(plan)
            collected = engine._collect()
            assert collected is not None  # just launched
            outputs = engine._process(*collected)
        except Exception as exc:  # noqa: BLE001 - it failed alone: it is the culprit
            engine._in_flight = None
            raise_if_device_lost(engine, exc)
            failed = engine._fail_request(request_id, exc)
            return [] if failed is None else [failed]
        req = engine.scheduler.get_request(request_id)
        if plan.scheduled[0].sample or req is None or not req.samples:
            engine._suspects.pop(request_id, None)  # passed a whole step alone
        return outputs


class BatchedStep(StepMode):
    """A step of the whole batch, its failures contained: any exception
    while collecting, planning or launching cannot be pinned on one request,
    so ``containment.recover`` sends every request it touched back to be
    recomputed, and the step returns nothing."""

    def run(self, engine: Engine) -> list[RequestOutput]:
        engine._touched = [] if engine._in_flight is None else [engine._in_flight[0]]
        try:
            collected, extra = self.advance(engine)
        except Exception as exc:  # noqa: BLE001 - contained, see Engine.step
            recover(engine, exc)
            return []
        finally:
            engine._touched = []
            engine._planning = False
        outputs = [] if collected is None else engine._process(*collected)
        if extra is not None:
            outputs.extend(engine._process_tokens(*extra))
        return outputs

    def advance(self, engine: Engine) -> tuple[Collected | None, Collected | None]:
        """Collect the step in flight and launch the next; returns what was
        collected (None: nothing was in flight), and tokens collected later
        in the call to process after it (or None)."""
        raise NotImplementedError


class PipelinedStep(BatchedStep):
    """Collect, plan and launch, then process while the device computes."""

    def advance(self, engine: Engine) -> tuple[Collected | None, Collected | None]:
        collected = engine._collect()
        engine._dispatch()
        return collected, None


class InteractiveFirstStep(BatchedStep):
    """``PipelinedStep`` with interactive outputs handed over first
    (``Engine.on_urgent_outputs``): the collected tokens of interactive
    requests are processed before the next step is planned, and when the
    step just launched is an interactive prompt's own (the scheduler gives
    one to a starting interactive prompt), it is waited for at once and its
    first tokens handed over in this call, before the batch rows collected
    earlier are processed."""

    def advance(self, engine: Engine) -> tuple[Collected | None, Collected | None]:
        extra = None
        collected = engine._collect()
        if collected is not None:
            collected = self._emit_urgent(engine, collected)
        engine._dispatch()
        if self._first_tokens_in_flight(engine):
            more = engine._collect()
            assert more is not None  # just launched
            more = self._emit_urgent(engine, more)
            engine._dispatch()
            if more[0]:
                extra = more
        return collected, extra

    @staticmethod
    def _first_tokens_in_flight(engine: Engine) -> bool:
        """Whether the step in flight holds interactive requests only (no
        scoring job's members), one of them about to sample its first
        token."""
        if engine._in_flight is None:
            return False
        first = False
        for s in engine._in_flight[0].scheduled:
            req = engine._requests.get(s.request_id)
            if (
                req is None
                or req.request_class is not RequestClass.INTERACTIVE
                or engine.scores.is_member(s.request_id)
            ):
                return False
            state = engine._states.get(s.request_id)
            first = first or (s.sample and state is not None and not state.token_ids)
        return first

    @staticmethod
    def _emit_urgent(engine: Engine, collected: Collected) -> Collected:
        """Process the collected tokens of interactive requests now and hand
        their outputs to ``on_urgent_outputs``; returns the rest of the
        collected step, to process after the next launch. Members of a
        scoring job are never urgent (their outputs are the job's)."""
        sampled, sampled_logprobs, finished_by_length = collected
        urgent = {}
        for rid in sampled:
            req = engine._requests.get(rid)
            if req is not None and req.request_class is RequestClass.INTERACTIVE and not engine.scores.is_member(rid):
                urgent[rid] = sampled[rid]
        if not urgent:
            return collected
        rest = {rid: tok for rid, tok in sampled.items() if rid not in urgent}
        outputs = engine._process_tokens(urgent, sampled_logprobs, finished_by_length)
        if outputs and engine.on_urgent_outputs is not None:
            engine.on_urgent_outputs(outputs)
        return rest, sampled_logprobs, finished_by_length


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
    (``StepResult.feedable``)."""

    def advance(self, engine: Engine) -> tuple[Collected | None, Collected | None]:
        assert engine._in_flight is not None  # choose() checked
        plan, result = engine._in_flight
        engine._in_flight = None
        engine.num_overlapped_steps += 1
        sampling = [s.request_id for s in plan.scheduled if s.sample]
        requests = {rid: engine.scheduler.get_request(rid) for rid in sampling}
        placeholders = dict.fromkeys(sampling, PENDING_TOKEN)
        finished_by_length = set(engine.scheduler.update_from_output(plan, placeholders))
        tokens = cast(jax.Array, result.tokens)  # feedable: still on the device
        engine._dispatch(prev=(tokens, {rid: i for i, rid in enumerate(sampling)}))
        engine._fault_point("fetch", [s.request_id for s in plan.scheduled])
        sampled, sampled_logprobs = by_request(sampling, *result.fetch())
        for request_id, token in sampled.items():
            req = requests[request_id]
            if req is not None and req.pending_index is not None:
                req.resolve_pending(token)
        engine.scores.record(plan, result.fetch_scores())  # (a feedable step has no score rows; parents may park)
        engine._finish_stopped(sampled, finished_by_length)
        return (sampled, sampled_logprobs, finished_by_length), None


_PIPELINED = PipelinedStep()
_INTERACTIVE_FIRST = InteractiveFirstStep()
_OVERLAPPED = OverlappedStep()


def choose(engine: Engine) -> StepMode:
    """The mode of the next step (see the module docstring)."""
    if engine._suspects:
        return IsolatedStep(next(iter(engine._suspects)))
    if engine.async_scheduling and engine._in_flight is not None and engine._in_flight[1].feedable:
        return _OVERLAPPED
    if engine.on_urgent_outputs is not None:
        return _INTERACTIVE_FIRST
    return _PIPELINED
