"""A request's host-side state inside the engine.

No prefill or decode mode (vLLM v1 style): a request has ``num_tokens``
(prompt + generated so far) and ``num_computed_tokens`` (those whose keys and
values are in the KV cache); each step closes part of the gap. When a step
computes up to ``num_tokens``, its last token yields the next sampled token,
so a request "decoding" is just one whose gap is 1.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from jaxserve.engine.block_allocator import BlockHash, hash_block_tokens
from jaxserve.engine.types import FinishReason, RequestClass

#: Stand-in for a sampled token whose value is still on the device (the
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams

#: engine plans the next step before fetching the previous one's tokens).
PENDING_TOKEN = -1


class RequestStatus(enum.IntEnum):
    """Where a request is. ``PREEMPTED`` is a waiting request that lost its
    blocks and will be recomputed; ``PARKED`` is a prefill-only request whose
    prompt is computed, holding its blocks until every request forked from it
    has started (label scoring); every ``FINISHED_*`` is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    PARKED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request as the scheduler tracks it.

    ``priority``: lower is served first (used by the ``priority`` policy).
    ``arrival_time`` and ``deadline`` are ``time.monotonic()`` values;
    ``deadline`` is optional and absolute. ``cache_salt`` is mixed into every
    block hash (model/adapter/tenant isolation of the prefix cache).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        request_class: RequestClass | str | int = RequestClass.INTERACTIVE,
        priority: int = 0,
        arrival_time: float | None = None,
        deadline: float | None = None,
        cache_salt: object = None,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("invalid_request", f"request_id must be a non-empty string, got {request_id!r}")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise RequestError("invalid_request", f"request {request_id!r} has an empty prompt")
        if any(t < 0 for t in prompt):
            raise RequestError("invalid_request", f"request {request_id!r} has a negative token id in its prompt")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError("invalid_request", f"priority must be an integer, got {priority!r}")
        try:
            self.request_class = RequestClass.parse(request_class)
        except ValueError as exc:
            raise RequestError("invalid_request", str(exc)) from None
        self.request_id = request_id
        self.prompt_token_ids: list[int] = prompt
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else float(arrival_time)
        self.deadline = None if deadline is None else float(deadline)
        self.cache_salt = cache_salt

        # Output produced before (a run that ended before finishing it:
        # Engine.add_request's ``prior``): computed with the prompt, as a
        # preempted request's output is.
        self.output_token_ids: list[int] = [int(t) for t in output_token_ids]
        self._all_token_ids: list[int] = prompt + self.output_token_ids
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0

        # KV blocks: the block table, and how many of its leading blocks are
        # registered in the prefix cache.
        self.block_ids: list[int] = []
        self.num_registered_blocks = 0
        # Chained hashes of every full block of all_token_ids (kept up to date
        # once enable_block_hashing was called).
        self.block_hashes: list[BlockHash] = []
        self._hash_block_size: int | None = None
        # index in all_token_ids of the one output token still on the device, if any
        self.pending_index: int | None = None
        # set by the first output token and never cleared (see is_expired)
        self.has_produced_output = bool(self.output_token_ids)
        # Label scoring (Engine.add_score_request). A *prefill-only* request
        # computes its tokens and stops: no sampling (a scoring job's prompt).
        # A *scoring* request never samples either: every position from
        # ``score_from`` on is a score row, whose logits give the probability
        # of ``score_targets[position - score_from]`` (teacher forcing).
        self.prefill_only = False
        self.score_from: int | None = None
        self.score_targets: list[int] = []
        #: a prefill-only request's forks: they continue its computed tokens,
        #: sharing its full blocks and a copy of its partial last block
        self.fork_children: list[Request] = []

        # Filled by the scheduler.
        self.seq_no = -1  # admission order, a tie-breaker after arrival_time
        self.num_cached_tokens = 0  # prefix-cache hit at the first schedule
        self.first_scheduled_time: float | None = None

    # ------------------------------------------------------------ token views

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the output (the live list: do not mutate)."""
        return self._all_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def samples(self) -> bool:
        """Whether finishing a chunk at ``num_tokens`` samples a token (a
        generation request) rather than ending the request's work."""
        return not self.prefill_only and self.score_from is None

    def score_rows(self, start: int, n: int) -> list[int]:
        """Targets of the score rows among positions ``start .. start+n``
        (always the chunk's last ones)."""
        if self.score_from is None:
            return []
        first = max(start, self.score_from)
        return self.score_targets[first - self.score_from : start + n - self.score_from]

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the KV cache."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def is_expired(self, now: float | None = None) -> bool:
        """Whether the deadline has passed. A deadline gates only work that
        has not produced anything yet: once the request has produced its
        first output token it never expires, even when it is preempted back
        to waiting later (or its tokens are recomputed after a failed step)."""
        if self.deadline is None or self.has_produced_output:
            return False
        return (time.monotonic() if now is None else now) >= self.deadline

    # ------------------------------------------------------------ mutation

    def append_output_token(self, token_id: int) -> None:
        """Append a sampled token, or ``PENDING_TOKEN`` for one still on the
        device (at most one; ``resolve_pending`` fills it in). Blocks holding
        a pending token are not hashed until it is known."""
        token_id = int(token_id)
        if token_id == PENDING_TOKEN:
            if self.pending_index is not None:
                raise ValueError(f"request {self.request_id!r} already has a pending token")
            self.pending_index = len(self._all_token_ids)
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.has_produced_output = True
        if self._hash_block_size is not None:
            self._extend_block_hashes()

    def truncate_output(self, num_output_tokens: int) -> None:
        """Forget every output token after the first ``num_output_tokens``
        (the engine's recovery from a failed step: tokens the failed step
        produced were never delivered, and are sampled again). Only for a
        request holding no KV blocks, since computed tokens are not touched."""
        if not isinstance(num_output_tokens, int) or not 0 <= num_output_tokens <= self.num_output_tokens:
            raise ValueError(
                f"request {self.request_id!r} has {self.num_output_tokens} output tokens; cannot keep "
                f"{num_output_tokens!r}"
            )
        if self.block_ids or self.num_computed_tokens:
            raise ValueError(f"request {self.request_id!r} still holds KV state: {self!r}")
        keep = self.num_prompt_tokens + num_output_tokens
        if self.pending_index is not None:
            if self.pending_index < keep:
                raise ValueError(
                    f"request {self.request_id!r} would keep its pending token (index {self.pending_index})"
                )
            self.pending_index = None
        del self.output_token_ids[num_output_tokens:]
        del self._all_token_ids[keep:]
        if self._hash_block_size is not None:
            del self.block_hashes[keep // self._hash_block_size :]
            self._extend_block_hashes()

    def resolve_pending(self, token_id: int) -> None:
        """Replace the pending token by its value."""
        if self.pending_index is None:
            raise ValueError(f"request {self.request_id!r} has no pending token")
        token_id = int(token_id)
        self._all_token_ids[self.pending_index] = token_id
        self.output_token_ids[self.pending_index - self.num_prompt_tokens] = token_id
        self.pending_index = None
        if self._hash_block_size is not None:
            self._extend_block_hashes()

    def enable_block_hashing(self, block_size: int) -> None:
        """Start keeping ``block_hashes`` for every full block (prompt and
        output alike), extended as tokens are appended."""
        if self._hash_block_size is not None and self._hash_block_size != block_size:
            raise ValueError(f"block hashing already set up for block size {self._hash_block_size}")
        self._hash_block_size = block_size
        self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        bs = self._hash_block_size
        assert bs is not None
        tokens = self._all_token_ids
        known = len(tokens) if self.pending_index is None else self.pending_index
        while (len(self.block_hashes) + 1) * bs <= known:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            self.block_hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], self.cache_salt))

    def sort_key(self, policy: str) -> tuple:
        """Service order: smaller is served first and preempted last."""
        if policy == "priority":
            return (int(self.request_class), self.priority, self.arrival_time, self.seq_no)
        return (int(self.request_class), self.arrival_time, self.seq_no)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.request_class.name.lower()}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={self.block_ids})"
        )
