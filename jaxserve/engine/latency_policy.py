"""The latency rules the scheduler consults while it plans a step.

The scheduler knows how to fit work into a step (token budget, sequence
slots, blocks); this policy says which batch work a step should *not* take
so that interactive requests see short steps (``SchedulerConfig``):

- ``interactive_prefill_alone``: a step that starts an interactive prompt
  holds interactive work only; the batch decodes wait one step, so the
  prompt's step is as short as on an idle engine. When no interactive
  prompt can start after all (no seat or block for it), the scheduler plans
  the step as usual (:meth:`StepRules.prefill_started_alone`).
- ``interactive_batch_prefill_tokens`` / ``interactive_recent_s``: while
  interactive work is about (waiting, running, or seen within
  ``interactive_recent_s``), batch prompt chunks and admissions together get
  at most that many tokens of the step: an arriving interactive prompt waits
  for the step in flight, and batch prompt tokens are what make a step long.
- ``interactive_step_tokens`` (the interactive cap): at such times a step's
  tokens, decodes included, are bounded too (interactive tokens are never
  cut; batch tokens get what they leave): the batch decodes beyond it wait a
  step, those served least recently going first.

Scheduler tests: ``tests/test_scheduler.py`` (``interactive_*``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxserve.engine.config import SchedulerConfig
from jaxserve.engine.request import Request
from jaxserve.engine.types import RequestClass


def _is_interactive(req: Request) -> bool:
    return req.request_class == RequestClass.INTERACTIVE


@dataclasses.dataclass
class StepRules:
    """What the policy decided for the step being planned.

    ``decodes``: the running decodes to serve first (batch ones the cap
    holds back are not in it). ``held``: batch decodes that wait while an
    interactive prompt may start alone; they are served after all when none
    does. ``step_cap``: the step's token cap (0: none)."""

    decodes: list[Request]
    held: list[Request]
    alone: bool
    interactive_about: bool
    step_cap: int
    batch_prefill_tokens: int

    def prefill_started_alone(self, planned: dict[str, tuple[Request, int, bool]]) -> bool:
        """Whether the step is an interactive prompt's own: ``alone`` held
        the batch back and a prompt chunk or an admission got planned."""
        return self.alone and any(n > 1 or is_new for _, n, is_new in planned.values())

    def batch_budget(self, budget: int, planned_tokens: int) -> int:
        """The token budget left to batch prompt chunks and admissions, which
        are planned last (nothing follows them)."""
        if self.batch_prefill_tokens and self.interactive_about:
            budget = min(budget, self.batch_prefill_tokens)
        if self.step_cap:
            budget = min(budget, self.step_cap - planned_tokens)
        return budget


class LatencyPolicy:
    """Keeps steps short for interactive requests (see the module docstring).

    Holds the two things the rules remember between steps: when interactive
    work was last about, and the step that last served each request (so the
    cap rotates over the batch decodes)."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._interactive_seen = float("-inf")  # clock() when interactive work was last about
        self._last_served: dict[str, int] = {}  # request id -> the last step that planned it

    def rules(self, running: list[Request], interactive_waiting: bool) -> StepRules:
        """The rules of the next step; ``running`` in service order."""
        cfg = self.config
        interactive = [r for r in running if _is_interactive(r)]
        about = self._interactive_about(bool(interactive) or interactive_waiting)
        decodes = [r for r in running if r.num_tokens_to_compute == 1]
        step_cap = cfg.interactive_step_tokens if about else 0
        if step_cap:
            n_interactive = sum(1 for r in decodes if _is_interactive(r))
            decodes = self._batch_decodes_within(decodes, max(0, step_cap - n_interactive))
        pending = interactive_waiting or any(r.num_tokens_to_compute > 1 for r in interactive)
        alone = cfg.interactive_prefill_alone and pending
        held: list[Request] = []
        if alone:
            held = [r for r in decodes if not _is_interactive(r)]
            decodes = [r for r in decodes if _is_interactive(r)]
        return StepRules(decodes, held, alone, about, step_cap, cfg.interactive_batch_prefill_tokens)

    def served(self, request_id: str, step: int) -> None:
        self._last_served[request_id] = step

    def forget(self, request_id: str) -> None:
        self._last_served.pop(request_id, None)

    def _batch_decodes_within(self, decodes: list[Request], limit: int) -> list[Request]:
        """``decodes`` with at most ``limit`` batch ones: those served least
        recently (then in running order), so every batch sequence advances
        in turn; interactive decodes all stay. Running order is kept."""
        batch = [r for r in decodes if not _is_interactive(r)]
        if len(batch) <= limit:
            return decodes
        order = {id(r): k for k, r in enumerate(batch)}
        chosen = sorted(batch, key=lambda r: (self._last_served.get(r.request_id, -1), order[id(r)]))[:limit]
        keep = {id(r) for r in chosen}
        return [r for r in decodes if _is_interactive(r) or id(r) in keep]

    def _interactive_about(self, present: bool) -> bool:
        """Whether interactive work is waiting or running (``present``), or
        was within ``interactive_recent_s``: the window keeps the batch steps
        short between the requests of an interactive stream."""
        now = self._clock()
        if present:
            self._interactive_seen = now
            return True
        return now - self._interactive_seen < self.config.interactive_recent_s
