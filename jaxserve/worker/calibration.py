"""Label calibration on the worker: each label's score on a content-free
input, computed by the engine once per (labels, form, template, few-shot
examples) and kept.

A calibrated job (``calibrate: true``) subtracts these scores from its own
before the softmax (:func:`jaxserve.engine.scoring.combine`). Every job of a
batch classified with the same labels and template shares one content-free
prompt, so the engine scores it once: the first job to need it submits one
score request, jobs that need it meanwhile wait for that same request, and
later ones read the cache. The key is the content-free request's token ids
(:meth:`jaxserve.tokenizer.labels.LabelTokens.identity`), so anything that
changes them (labels, form, chat template, examples) is another entry.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from jaxserve.request_error import RequestError
from jaxserve.tokenizer.labels import LabelTokens

DEFAULT_CAPACITY = 1024

#: submit(request_id, tokens, request_class, priority): hands one score request to the engine
Submit = Callable[[str, LabelTokens, Any, int], Awaitable[Any]]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The content-free scores of one label set: summed log-probabilities and
    token counts, in the labels' order (normalized by the caller, as the job's own)."""

    logprobs: tuple[float, ...]
    token_counts: tuple[int, ...]


class LabelCalibrations:
    """The worker's calibration cache and its in-flight requests (one event
    loop; not thread-safe)."""

    def __init__(self, submit: Submit, capacity: int = DEFAULT_CAPACITY) -> None:
        self._submit = submit
        self._capacity = capacity
        self._done: collections.OrderedDict[str, Calibration] = collections.OrderedDict()
        self._pending: dict[str, asyncio.Future[Calibration]] = {}
        self._by_request: dict[str, tuple[str, LabelTokens]] = {}
        self._ids = itertools.count()
        self.computed = 0  # engine requests made (the cache's misses)

    def __len__(self) -> int:
        return len(self._done)

    async def get(self, tokens: LabelTokens, request_class: Any, priority: int = 0) -> Calibration:
        """The calibration of ``tokens`` (the content-free request). Raises the
        engine's :class:`RequestError` when it refuses or fails the request;
        any other exception means the engine is gone."""
        key = tokens.identity()
        hit = self._done.get(key)
        if hit is not None:
            self._done.move_to_end(key)
            return hit
        fut = self._pending.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._pending[key] = fut
            request_id = f"label-calibration-{key[:12]}-{next(self._ids)}"
            self._by_request[request_id] = (key, tokens)
            self.computed += 1
            try:
                await self._submit(request_id, tokens, request_class, priority)
            except BaseException as exc:
                self._by_request.pop(request_id, None)
                self._fail(key, exc)
                raise
        return await asyncio.shield(fut)

    def on_output(self, out: Any) -> bool:
        """Route one engine output: True if it answered a calibration request."""
        entry = self._by_request.get(out.request_id)
        if entry is None:
            return False
        if not out.finished:
            return True
        del self._by_request[out.request_id]
        key, tokens = entry
        if out.error is not None or out.label_logprobs is None:
            err = out.error or RequestError(
                "internal", "the engine returned no label scores for the calibration input", retryable=True
            )
            self._fail(key, err)
            return True
        cal = Calibration(tuple(float(x) for x in out.label_logprobs), tuple(len(ids) for ids in tokens.label_ids))
        self._done[key] = cal
        while len(self._done) > self._capacity:
            self._done.popitem(last=False)
        fut = self._pending.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(cal)
        return True

    def _fail(self, key: str, exc: BaseException) -> None:
        fut = self._pending.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)
            fut.exception()  # retrieved: a failure nobody else waits on is not logged as unhandled
