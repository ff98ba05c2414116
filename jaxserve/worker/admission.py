"""Admission control for interactive jobs: refuse at once what cannot start
in time, instead of letting it wait.

The interactive work a worker holds is bounded by sequences (the prefetch)
and by tokens: the prompt tokens of the interactive jobs it holds that have
not produced their first token yet must be prefilled before a new job's
first token, so their sum plus the new job's prompt is held under a budget of
``target_ttft_s`` x the engine's prefill rate (vLLM's max-num-queued-tokens,
derived from a latency target). A job over the budget is answered
``overloaded`` (retryable) with ``retry_after_s``: the time the backlog over
the budget takes to prefill. The first job is always admitted, however long.

The prefill rate is measured: tokens the engine computed per second of its
busy time, smoothed, starting from ``initial_prefill_tokens_per_s``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class AdmissionConfig:
    target_ttft_s: float = 2.0
    #: a fixed budget in tokens (overrides target_ttft_s x the measured rate)
    max_queued_tokens: int | None = None
    initial_prefill_tokens_per_s: float = 2000.0
    #: batch consumption pauses above this share of the budget, resumes below half of it
    pause_batch_at: float = 0.8


class InteractiveAdmission:
    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.rate = cfg.initial_prefill_tokens_per_s
        self._held: dict[str, int] = {}
        self._last: tuple[float, float] | None = None  # (computed tokens, busy seconds) at the last sample

    @property
    def budget(self) -> int:
        if self.cfg.max_queued_tokens is not None:
            return self.cfg.max_queued_tokens
        return max(1, int(self.cfg.target_ttft_s * self.rate))

    @property
    def held_tokens(self) -> int:
        return sum(self._held.values())

    def try_admit(self, key: str, prompt_tokens: int) -> float | None:
        """Reserve the job's prompt in the budget: None when admitted, else
        the seconds after which it may be."""
        held = self.held_tokens
        if held and held + prompt_tokens > self.budget:
            excess = held + prompt_tokens - self.budget
            return round(max(0.1, excess / self.rate), 3)
        self._held[key] = prompt_tokens
        return None

    def admit(self, key: str, prompt_tokens: int) -> None:
        """Reserve the job's prompt whatever the budget says: a job that
        accepted a degraded answer instead of ``overloaded`` runs anyway
        (``jaxserve.worker.fallback``), and later jobs must still see its
        prompt ahead of theirs."""
        self._held[key] = prompt_tokens

    def release(self, key: str) -> None:
        """The job produced its first token, or ended."""
        self._held.pop(key, None)

    def observe(self, computed_tokens: float, busy_s: float) -> None:
        """Feed the engine's cumulative computed tokens and busy seconds."""
        if self._last is not None:
            dt, db = computed_tokens - self._last[0], busy_s - self._last[1]
            if db > 0.05 and dt > 0:
                self.rate = 0.8 * self.rate + 0.2 * (dt / db)
        self._last = (computed_tokens, busy_s)

    @property
    def pressure(self) -> float:
        return self.held_tokens / self.budget
