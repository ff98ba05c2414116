"""``LLM``: offline generation over the engine, for scripts and benchmarks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

from jaxserve.engine import scoring
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.engine.types import RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams


class LLM:
    """Build an engine, compile it, and run whole batches of prompts.

    >>> llm = LLM("tiny")
    >>> [out] = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        engine_args = {k: v for k, v in {"model": model, **engine_args}.items() if v is not None}
        # the offline profile: a bigger step budget (jaxserve.engine.args.PROFILES)
        self.engine = Engine(EngineArgs.for_profile("offline", **engine_args))
        self.engine.warmup()
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt the engine refuses yields a finished output carrying the
        :class:`RequestError` instead of raising, so one bad prompt does not
        sink a batch.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        order: list[str] = []
        done: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params):
            request_id = f"llm-{next(self._ids)}"
            order.append(request_id)
            try:
                self.engine.add_request(request_id, prompt, p)
            except RequestError as exc:
                done[request_id] = RequestOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason="error",
                    error=exc,
                )
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[request_id] for request_id in order]

    def score(
        self,
        prompts: Sequence[str | Sequence[int]],
        labels: Sequence[str] | Sequence[Sequence[str]],
        *,
        label_normalization: str = "sum",
    ) -> list[list[scoring.ScoredLabel] | RequestError]:
        """Label scoring for every prompt (the same ``labels`` for all, or one
        list per prompt): each label scored as a continuation of the prompt
        (its tokens encoded alone, without special tokens), in the labels'
        order; :func:`jaxserve.engine.scoring.best` picks the winner. A
        prompt the engine refuses yields its :class:`RequestError`."""
        # one list of names per prompt (labels: names, or lists of names)
        per_prompt = cast(
            list[list[str]],
            [list(labels)] * len(prompts) if labels and isinstance(labels[0], str) else [list(x) for x in labels],
        )
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(per_prompt)} label lists")
        tok = self.engine.tokenizer
        order: list[tuple[str, list[str], list[list[int]]]] = []
        done: dict[str, RequestOutput | RequestError] = {}
        for prompt, names in zip(prompts, per_prompt):
            request_id = f"llm-{next(self._ids)}"
            ids = [tok.encode(name, add_special_tokens=False) for name in names]
            order.append((request_id, names, ids))
            try:
                self.engine.add_score_request(request_id, prompt, ids)
            except RequestError as exc:
                done[request_id] = exc
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out.error if out.error is not None else out
        results: list[list[scoring.ScoredLabel] | RequestError] = []
        for request_id, names, ids in order:
            res = done[request_id]
            if isinstance(res, RequestError):
                results.append(res)
                continue
            # a finished score request without an error has its label scores
            logprobs = cast(list[float], res.label_logprobs)
            results.append(scoring.combine(names, logprobs, [len(x) for x in ids], label_normalization))
        return results
