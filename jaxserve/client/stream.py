"""The :class:`Stream` of one job's text deltas: puts chunks in order, drops
duplicates, counts gaps and fills them from the final result. Apart from
``AsyncClient`` because it is the one piece of the client with its own
ordering logic (``tests/test_queue_worker.py`` checks its gaps and
duplicates, ``tests/test_queue_admission.py`` its first chunk); re-exported from
``jaxserve.client`` and ``jaxserve.client.client``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from jaxserve.client.errors import JobError, StreamDiverged
from jaxserve.wire import Chunk, Result

if TYPE_CHECKING:
    from jaxserve.client.client import AsyncClient


class Stream:
    """Async iterator of text deltas of one job. After iteration,
    ``result`` holds the final :class:`Result`; ``gaps`` counts chunks that
    arrived out of order or never arrived. ``first_chunk_at`` is the
    ``time.monotonic()`` at which the first chunk reached this client (time
    to first token, even when that token's text is still empty: a partial
    UTF-8 character, a special token). ``started`` is set, and ``first``
    holds the message, when the first reply (a chunk, or a final result
    such as a refusal) arrives, before anything is iterated: a caller that
    must answer a refusal differently from a stream (the HTTP gateway's
    status code) waits on it."""

    def __init__(self, client: AsyncClient, key: str, timeout: float | None) -> None:
        self.client = client
        self.key = key
        self.timeout = timeout
        self.result: Result | None = None
        self.gaps = 0
        self.duplicates = 0
        self.chunks = 0
        self.first_chunk_at: float | None = None
        self.started = asyncio.Event()
        self.first: Chunk | Result | None = None
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._yielded: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._yielded)

    def close(self) -> None:
        """Stop routing this job's replies here (iterating to the end does it
        too); for a caller that gives up on the stream before its end."""
        self.client._streams.pop(self.key, None)

    def _deliver(self, msg: Chunk | Result) -> None:
        if self.first_chunk_at is None and isinstance(msg, Chunk):
            self.first_chunk_at = time.monotonic()
        if self.first is None:
            self.first = msg
            self.started.set()
        self._inbox.put_nowait(msg)

    async def __aiter__(self) -> AsyncIterator[str]:
        expected = 0
        run: str | None = None
        buffered: dict[int, str] = {}
        foreign_run = False
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    msg = await asyncio.wait_for(self._inbox.get(), wait)
                except TimeoutError:
                    raise TimeoutError(f"no final result for {self.key!r} within {self.timeout}s") from None
                if isinstance(msg, Chunk):
                    self.chunks += 1
                    if run is None:
                        run = msg.run
                    elif msg.run != run:
                        if not self._yielded and msg.seq == 0:
                            run, expected, buffered = msg.run, 0, {}
                        else:
                            foreign_run = True  # a restart elsewhere: rely on the final
                            continue
                    if msg.seq < expected or msg.seq in buffered:
                        self.duplicates += 1
                        continue
                    buffered[msg.seq] = msg.text
                    if msg.seq > expected:
                        self.gaps += 1
                        continue
                    while expected in buffered:
                        delta = buffered.pop(expected)
                        expected += 1
                        if delta:
                            self._yielded.append(delta)
                            yield delta
                    continue
                self.result = msg
                if not msg.ok:
                    raise JobError(msg)
                so_far = self.text
                full = msg.text or ""
                if buffered and not foreign_run:
                    # chunks were lost in the middle: the final fills in
                    self.gaps = max(self.gaps, 1)
                if full.startswith(so_far):
                    rest = full[len(so_far) :]
                    if rest:
                        self._yielded.append(rest)
                        yield rest
                else:
                    raise StreamDiverged(msg)
                return
        finally:
            self.client._streams.pop(self.key, None)
