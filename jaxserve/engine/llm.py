"""``LLM``: offline generation over the engine, for scripts and benchmarks."""

from __future__ import annotations

import itertools
from typing import Sequence

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.engine.types import RequestError, RequestOutput, SamplingParams


class LLM:
    """Build an engine, compile it, and run whole batches of prompts.

    >>> llm = LLM("tiny")
    >>> [out] = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str = "tiny", **engine_args) -> None:
        engine_args = {k: v for k, v in engine_args.items() if v is not None}
        self.engine = Engine(EngineArgs(model=model, **engine_args))
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
                    request_id=request_id, new_token_ids=[], new_text="", finished=True,
                    finish_reason="error", error=exc,
                )
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[request_id] for request_id in order]
