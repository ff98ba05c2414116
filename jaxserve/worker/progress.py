"""Saved tokens: each running job's generated tokens go to the store as
they come, so that when its worker dies the worker that takes the
redelivery continues from them instead of from nothing.

Each run keeps its own output so far in a :class:`Progress` (fed by its
engine outputs); the worker's one :class:`TokenSaver` writes what the runs
it watches generated since their last save: when one of them has
``every_tokens`` unsaved tokens, else every ``every_s`` seconds, all of them
in one store write (``IdempotencyStore.save_tokens``: one transaction, or
one Redis pipeline), each as a :class:`~jaxserve.worker.store.TokenChunk`
of the new tokens only, so a save costs what was generated since the last,
whatever the length of the output. A job whose worker is SIGKILLed loses
at most what it generated since its last save.

On the way back (``steps.saved_tokens``) the run reads its key's chunks
(:func:`prior_output`), keeps those written for the same job body and
model, and hands them to the engine as the request's prior output
(``Engine.add_request(prior=...)``): computed with the prompt, then
generation goes on as the first run's would have, for the same text on
greedy and seeded jobs (every sampled job has a seed: its key's, when it
gives none). The saved tokens go when the result is stored (in the same
store write), or when the run ends with an error; a run that goes back to
the broker while it still holds the key's claim saves what it has first.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Iterable
from typing import Any

import structlog

from jaxserve.engine.types import PriorOutput, RequestOutput
from jaxserve.worker.store import IdempotencyStore, StoreUnavailable, TokenChunk
from jaxserve.worker.store_health import StoreHealth

log = structlog.get_logger("jaxserve.worker")


class Progress:
    """One run's output so far, and how much of it is saved.

    ``logprobs`` / ``top``: kept when the job asks for them (a resumed run
    gives them back); a job that asks for them from an engine whose
    outputs do not carry them is not saved at all (``usable`` false)."""

    def __init__(self, key: str, fingerprint: str | None, model: str | None, *, logprobs: bool, top: bool) -> None:
        self.key = key
        self.fingerprint = fingerprint
        self.model = model
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = [] if logprobs else None
        self.top: list[tuple[tuple[int, float], ...]] | None = [] if top else None
        self.saved = 0  # how many of token_ids are in the store
        self.usable = True

    @property
    def unsaved(self) -> int:
        return len(self.token_ids) - self.saved if self.usable else 0

    def resume(self, prior: PriorOutput) -> None:
        """The run starts from ``prior`` (read from the store: saved already)."""
        self.token_ids = list(prior.token_ids)
        if self.logprobs is not None:
            self.logprobs = list(prior.logprobs or ())
        if self.top is not None:
            self.top = list(prior.top_logprobs or ())
        self.saved = len(self.token_ids)

    def add(self, out: RequestOutput) -> None:
        """One engine output. Its tokens begin at output position
        ``completion_tokens - len(new_token_ids)`` (a resumed request may have
        taken fewer prior tokens than it was given: then it starts before
        the end of what was saved, and what follows is written again)."""
        new = out.new_token_ids
        if not new or not self.usable:
            return
        start = out.completion_tokens - len(new)
        if start < 0 or start > len(self.token_ids):
            self.usable = False
            return
        del self.token_ids[start:]
        self.token_ids.extend(new)
        self.saved = min(self.saved, start)
        if self.logprobs is not None:
            if out.new_logprobs is None or len(out.new_logprobs) != len(new):
                self.usable = False
                return
            del self.logprobs[start:]
            self.logprobs.extend(out.new_logprobs)
        if self.top is not None:
            if out.new_top_logprobs is None or len(out.new_top_logprobs) != len(new):
                self.usable = False
                return
            del self.top[start:]
            self.top.extend(tuple((int(t), float(lp)) for t, lp in row) for row in out.new_top_logprobs)

    def chunk(self) -> TokenChunk:
        """What is not saved yet."""
        start = self.saved
        return TokenChunk(
            start,
            tuple(self.token_ids[start:]),
            self.fingerprint,
            self.model,
            None if self.logprobs is None else tuple(self.logprobs[start:]),
            None if self.top is None else tuple(self.top[start:]),
        )


def prior_output(
    chunks: Iterable[TokenChunk], fingerprint: str | None, model: str | None, *, logprobs: bool, top: bool
) -> PriorOutput | None:
    """A key's saved chunks as the prior output of a run of the job with
    this ``fingerprint`` on this ``model``; None when there is none (or
    none it can use: another body's, another model's, without the logprobs
    the job asks for)."""
    ids: list[int] = []
    lps: list[float] = []
    tops: list[tuple[tuple[int, float], ...]] = []
    for c in chunks:
        if c.fingerprint != fingerprint or c.model != model or c.start > len(ids):
            continue
        if (logprobs and c.logprobs is None) or (top and c.top_logprobs is None):
            return None
        del ids[c.start :], lps[c.start :], tops[c.start :]
        ids.extend(c.token_ids)
        lps.extend(c.logprobs or ())
        tops.extend(c.top_logprobs or ())
    if not ids:
        return None
    return PriorOutput(tuple(ids), tuple(lps) if logprobs else None, tuple(tops) if top else None)


@dataclasses.dataclass(eq=False)
class TokenSaver:
    """Writes the unsaved tokens of the runs it watches (see the module
    docstring). ``every_tokens`` 0: nothing is saved (``enabled`` false).
    Store failures mark the store down (``store_health``) and skip the save:
    the tokens go with the next one."""

    store: IdempotencyStore
    store_health: StoreHealth
    _: dataclasses.KW_ONLY
    every_tokens: int
    every_s: float
    stats: collections.Counter
    _watched: dict[str, Progress] = dataclasses.field(init=False, default_factory=dict)
    _due: asyncio.Event = dataclasses.field(init=False, default_factory=asyncio.Event)
    #: one write at a time; an unwatch waits for the one in progress
    _lock: asyncio.Lock = dataclasses.field(init=False, default_factory=asyncio.Lock)

    @property
    def enabled(self) -> bool:
        return self.every_tokens > 0

    def watch(self, progress: Progress) -> None:
        self._watched[progress.key] = progress

    def noted(self, progress: Progress) -> None:
        """``progress`` grew: its tokens are due when enough piled up."""
        if progress.unsaved >= self.every_tokens:
            self._due.set()

    async def unwatch(self, progress: Progress, *, save: bool = False, drop: bool = False) -> None:
        """Stop saving ``progress`` (after the write in progress, if any).
        ``save``: write what is unsaved first (a run going back to the
        broker); ``drop``: delete what the store holds (a run answered with
        an error)."""
        async with self._lock:
            if self._watched.get(progress.key) is progress:
                del self._watched[progress.key]
            if save and progress.unsaved:
                await self._write([progress])
            if drop:
                await self._best_effort(self.store.drop_tokens, progress.key)

    async def run(self) -> None:
        """Save every ``every_s`` seconds, or as soon as a run has
        ``every_tokens`` unsaved tokens."""
        while True:
            try:
                await asyncio.wait_for(self._due.wait(), self.every_s)
            except TimeoutError:
                pass
            self._due.clear()
            async with self._lock:
                await self._write([p for p in self._watched.values() if p.unsaved])

    async def _write(self, runs: list[Progress]) -> None:
        if not runs or not self.store_health.up:
            return
        chunks = [(p.key, p.chunk()) for p in runs]
        try:
            await self.store.save_tokens(chunks)
        except StoreUnavailable as exc:
            self.stats["tokens_save_skipped"] += 1
            self.store_health.failed(exc)
            log.warning("tokens_save_skipped", jobs=len(runs), error=str(exc))
            return
        for p, (_, chunk) in zip(runs, chunks):
            p.saved = max(p.saved, chunk.start + len(chunk.token_ids))
        self.stats["tokens_saves"] += 1
        self.stats["tokens_saved"] += sum(len(c.token_ids) for _, c in chunks)

    async def _best_effort(self, fn: Any, *args: Any) -> None:
        await self.store_health.best_effort("drop_tokens", fn, *args, stats=self.stats)
