"""Turns sampled token ids into text deltas and decides when a request stops.

Kept apart from the scheduler (which only counts tokens) and the runner
(which only computes them): this is the one place that knows about EOS,
stop token ids, stop strings and ``max_tokens``.

Stop strings may straddle tokens, so while a request runs the last
``len(longest stop) - 1`` characters are held back from the streamed
deltas; a stop string never leaks to a streaming client and is cut from
the final text (OpenAI semantics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxserve.engine.types import FinishReason, RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class TokenVerdict:
    """What one new token did to a request."""

    accepted: bool  # the token belongs to the completion (EOS/stop ids do not)
    delta: str  # text that may be streamed now
    finish_reason: FinishReason | None


class OutputState:
    """Per-request detokenization and stop-condition state."""

    def __init__(
        self,
        tokenizer,
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.params = params
        self.num_prompt_tokens = len(prompt_ids) if prompt_ids is not None else 0
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_token_ids)
        self.stops = tuple(params.stop)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        #: per completion token, its most likely alternatives (``SamplingParams.top_logprobs``)
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: FinishReason | None = None
        #: tokens given to ``add_token`` (stop ids included): how many of the
        #: request's sampled tokens have been delivered
        self.num_tokens_seen = 0

    def add_token(
        self, token_id: int, logprob: float | None = None, top: list[tuple[int, float]] | None = None
    ) -> TokenVerdict:
        if self.finish_reason is not None:
            raise RuntimeError(f"token {token_id} arrived after the request finished ({self.finish_reason})")
        self.num_tokens_seen += 1
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
            self.text += self.detok.flush()
            return TokenVerdict(False, self._release(final=True), "stop")
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(float(logprob))
        if top is not None:
            self.top_logprobs.append(top)
        before = len(self.text)
        self.text += self.detok.push(token_id)
        if len(self.token_ids) >= self.params.max_tokens:
            self.text += self.detok.flush()
        if self.stops and self._cut_at_stop(before):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        return TokenVerdict(True, self._release(final=self.finish_reason is not None), self.finish_reason)

    def resume(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    ) -> int:
        """Take output an earlier run of the request produced (``PriorOutput``)
        as if each token had just come: detokenized, counted toward
        ``max_tokens``, checked against the stop strings. Stops before a
        token that would end the request (the request samples it again,
        and ends then); returns how many were taken. Their text is not
        released here: the next delta carries it, so a request's deltas
        still concatenate to its whole text."""
        taken = 0
        for i, token in enumerate(token_ids):
            verdict = self.add_token(
                int(token),
                None if logprobs is None else logprobs[i],
                None if top_logprobs is None else [(int(t), float(lp)) for t, lp in top_logprobs[i]],
            )
            if verdict.finish_reason is not None:
                break
            taken += 1
        self.emitted = 0
        return taken

    def force_finish(self, reason: FinishReason) -> str:
        """End the request for a reason decided elsewhere (``max_model_len``);
        returns the text still held back."""
        self.finish_reason = reason
        self.text += self.detok.flush()
        return self._release(final=True)

    def output(
        self,
        request_id: str,
        delta: str,
        new_ids: list[int],
        finish: FinishReason | None,
        metrics: dict[str, float],
        now: float,
    ) -> RequestOutput:
        """One step's output for this request; a final one (``finish`` set)
        carries the whole completion and stamps ``metrics["finished"]``."""
        out = RequestOutput(
            request_id=request_id,
            new_token_ids=new_ids,
            new_text=delta,
            finished=finish is not None,
            finish_reason=finish,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=len(self.token_ids),
            metrics=metrics,
        )
        if self.params.logprobs and new_ids:
            out.new_logprobs = self.logprobs[-len(new_ids) :]
            if self.params.top_logprobs:
                out.new_top_logprobs = self.top_logprobs[-len(new_ids) :]
        if finish is not None:
            metrics["finished"] = now
            out.text = self.text
            out.token_ids = list(self.token_ids)
            out.logprobs = list(self.logprobs) if self.params.logprobs else None
            out.top_logprobs = list(self.top_logprobs) if self.params.logprobs and self.params.top_logprobs else None
        return out

    def error_output(
        self, request_id: str, error: RequestError, metrics: dict[str, float], now: float
    ) -> RequestOutput:
        """The final output of a request that ``error`` ended."""
        metrics["finished"] = now
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=len(self.token_ids),
            error=error,
            metrics=metrics,
        )

    def _cut_at_stop(self, before: int) -> bool:
        start = max(0, before - self.holdback)
        best = -1
        for stop in self.stops:
            i = self.text.find(stop, start)
            if i != -1 and (best == -1 or i < best):
                best = i
        if best == -1:
            return False
        self.text = self.text[:best]
        return True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
