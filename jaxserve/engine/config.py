"""Scheduler settings (a plain dataclass, validated on creation; the engine-level
settings users pass are ``jaxserve.engine.args.EngineArgs``).

The engine builds it with ``EngineArgs.scheduler_config``. A field that
``EngineArgs`` also has takes its default from there (written once, the
measurements behind it documented there); the sizes the engine resolves
(``max_num_batched_tokens``, ``max_model_len``, ``num_blocks``) have
defaults here for a scheduler built on its own (tests).

It validates in ``__post_init__``, so ``dataclasses.replace(cfg, ...)``
re-checks the new values. Errors are ``ValueError`` naming the field, the bad
value and what was expected.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

SchedulingPolicy = Literal["fcfs", "priority"]
_POLICIES = ("fcfs", "priority")


def _engine(name: str) -> Any:
    """A field whose default is ``EngineArgs``' (looked up when a config is
    built: ``jaxserve.engine.args`` imports this module)."""

    def default() -> Any:
        from jaxserve.engine.args import engine_default

        return engine_default(name)

    return dataclasses.field(default_factory=default)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _require_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass
class SchedulerConfig:
    """What the scheduler may put in one step and how it orders requests.

    - ``max_num_seqs``: sequences running at once (each has blocks and gets
      up to one sampled token per step).
    - ``max_num_batched_tokens``: tokens computed in one step, all sequences
      together. Must be >= ``max_num_seqs`` so every running sequence can
      always take its decode token.
    - ``max_model_len``: prompt + generated tokens of one request.
    - ``block_size``: tokens per KV block; ``num_blocks`` counts block 0, the
      null block, so ``num_blocks - 1`` are usable.
    - ``policy``: ``'fcfs'`` (arrival order) or ``'priority'`` (lower
      ``priority`` value first, then arrival), applied within each class;
      interactive requests always come before batch ones.
    - ``interactive_reserved_seqs`` / ``interactive_reserved_blocks``: sequence
      slots and KV blocks batch requests may never take, kept for interactive
      traffic.
    - ``long_prefill_token_threshold``: most prompt tokens one request may
      compute in one step (0: no cap beyond the step budget).
    - ``max_num_waiting``: waiting requests beyond which ``add_request``
      refuses with ``overloaded`` (retryable); 0: unbounded.
    - ``interactive_prefill_alone``: a step that can start an interactive
      prompt (a new interactive request, or an interactive prompt chunk)
      carries interactive work only; batch sequences skip that step. The
      interactive prefill then costs what it costs on an idle worker
      instead of sharing its step with every running batch sequence
      (measured in BENCHMARKS.md); batch throughput pays one step per
      interactive prompt.
    - ``interactive_batch_prefill_tokens`` / ``interactive_recent_s``: while
      interactive work is about (an interactive request waiting or running,
      or one seen within the last ``interactive_recent_s`` seconds), one
      step carries at most this many batch prompt tokens (0: no cap beyond
      the step budget). A prompt that arrives waits for the step in flight,
      and the steps that carry batch prompt chunks are the long ones, so
      this bounds that wait; batch decodes are never held back by it, and
      batch-only serving is untouched.
    - ``interactive_step_tokens``: at the same times, a step that carries
      batch work carries at most this many tokens in all, decodes and
      prompt chunks, interactive and batch (0: no cap). Interactive tokens
      are never cut; batch tokens get what they leave. An interactive
      prompt that arrives waits for the rest of the step in flight, and a
      step of many batch decodes is long (each sequence's row costs about
      what a prompt token does; the runner pads a step to its token
      bucket, so a cap at a bucket size is the one that pays); the batch
      decodes beyond the cap wait a step, served least recently first, so
      each advances in turn.
    - ``num_speculative_tokens``: most guessed tokens a decoding sequence
      carries into one step (speculative decoding,
      ``jaxserve.engine.speculative``; 0: none). Guesses are planned last,
      in the budget, logits rows and blocks the step leaves, so they never
      delay a prompt or preempt anyone.
    """

    max_num_seqs: int = _engine("max_num_seqs")
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = _engine("block_size")
    num_blocks: int = 1024
    policy: SchedulingPolicy = _engine("policy")
    interactive_reserved_seqs: int = _engine("interactive_reserved_seqs")
    interactive_reserved_blocks: int = _engine("interactive_reserved_blocks")
    enable_prefix_caching: bool = _engine("enable_prefix_caching")
    long_prefill_token_threshold: int = _engine("long_prefill_token_threshold")
    max_num_waiting: int = _engine("max_num_waiting")
    interactive_prefill_alone: bool = _engine("interactive_prefill_alone")
    interactive_batch_prefill_tokens: int = _engine("interactive_batch_prefill_tokens")
    interactive_recent_s: float = _engine("interactive_recent_s")
    interactive_step_tokens: int = _engine("interactive_step_tokens")
    num_speculative_tokens: int = _engine("num_speculative_tokens")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def max_blocks_per_seq(self) -> int:
        return _cdiv(self.max_model_len, self.block_size)

    @property
    def max_num_logits_rows(self) -> int:
        """Rows of logits one step may sample or score: one per sequence,
        and with speculative decoding one more per guessed token
        (``num_speculative_tokens`` per sequence at most, within the step's
        token budget). The runner's programs are compiled for this many."""
        if not self.num_speculative_tokens:
            return self.max_num_seqs
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.num_speculative_tokens))

    def validate(self) -> None:
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _require_int("max_model_len", self.max_model_len, 2)
        _require_int("block_size", self.block_size, 1)
        _require_int("num_blocks", self.num_blocks, 2)
        _require_int("interactive_reserved_seqs", self.interactive_reserved_seqs, 0)
        _require_int("interactive_reserved_blocks", self.interactive_reserved_blocks, 0)
        _require_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _require_int("max_num_waiting", self.max_num_waiting, 0)
        _require_int("interactive_batch_prefill_tokens", self.interactive_batch_prefill_tokens, 0)
        _require_int("interactive_step_tokens", self.interactive_step_tokens, 0)
        _require_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        recent = self.interactive_recent_s
        if isinstance(recent, bool) or not isinstance(recent, (int, float)) or not 0 <= recent < float("inf"):
            raise ValueError(f"interactive_recent_s must be a finite number of seconds >= 0, got {recent!r}")
        if self.policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {self.policy!r}")
        for name in ("enable_prefix_caching", "interactive_prefill_alone"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), so every running sequence can take its token each step"
            )
        if self.interactive_reserved_seqs >= self.max_num_seqs:
            raise ValueError(
                f"interactive_reserved_seqs ({self.interactive_reserved_seqs}) must be < max_num_seqs "
                f"({self.max_num_seqs}), or batch requests could never run"
            )
        usable = self.num_blocks - 1
        if self.max_blocks_per_seq > usable:
            raise ValueError(
                f"a request of max_model_len={self.max_model_len} tokens needs {self.max_blocks_per_seq} blocks of "
                f"{self.block_size} tokens but only {usable} are usable (num_blocks={self.num_blocks}, block 0 "
                f"reserved); raise num_blocks or lower max_model_len"
            )
        if self.max_blocks_per_seq > usable - self.interactive_reserved_blocks:
            raise ValueError(
                f"interactive_reserved_blocks={self.interactive_reserved_blocks} leaves batch requests "
                f"{usable - self.interactive_reserved_blocks} of {usable} usable blocks, fewer than the "
                f"{self.max_blocks_per_seq} one request of max_model_len={self.max_model_len} needs"
            )
