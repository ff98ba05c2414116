"""What one job's run holds, each registered when taken with how to give
it back, and given back by the run's ending (``jaxserve.worker.job_run``):
the deadline timer, the engine slot, the chunk sender, the saving of its
tokens, the interactive admission hold, the tenant's count and tokens, the
claim on the key.

A resource is never released by hand at the places a run can end: the
ending (finish, requeue, defer) releases whatever is still held, so a new
resource or a new way to end cannot leak one (``tests/test_job_run.py``
ends running jobs each way and checks the worker holds nothing after).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable


@dataclasses.dataclass(frozen=True)
class Ending:
    """How a run ends, as its resources see it: ``ok`` (an ok result is
    stored: the store's put ends the claim), the tokens it used and what
    they cost (its result's ``usage.cost``: the tenant's budget gets the
    rest of its estimate back), and whether it goes back to the broker (a
    sender is cancelled, not flushed)."""

    ok: bool = False
    used_tokens: int = 0
    used_cost: float = 0.0
    requeued: bool = False


Release = Callable[[Ending], Awaitable[None] | None]


class Holdings:
    """What one run holds, each with how to give it back. Released in
    :data:`ORDER` (the engine slot before the sender, so no output arrives
    for a flushed sender; the saved tokens before the claim, so a run going
    back saves its last tokens while the key is still its own; the claim
    last, after the result is stored)."""

    ORDER = ("deadline", "engine", "sender", "progress", "admission", "tenant", "claim")

    def __init__(self) -> None:
        self._held: dict[str, Release] = {}

    def take(self, name: str, release: Release) -> None:
        assert name in self.ORDER, name
        self._held[name] = release

    def holds(self, name: str) -> bool:
        return name in self._held

    def forget(self, name: str) -> None:
        """The resource ended on its own (the engine finished the request,
        another worker owns the claim now): nothing to give back."""
        self._held.pop(name, None)

    def release_now(self, name: str) -> None:
        """Give back a resource whose release is synchronous, early (the
        first token ends the deadline and the admission hold)."""
        release = self._held.pop(name, None)
        if release is not None:
            assert release(Ending()) is None

    async def release(self, ending: Ending, *names: str) -> None:
        for name in names or self.ORDER:
            release = self._held.pop(name, None)
            if release is not None:
                pending = release(ending)
                if pending is not None:
                    await pending
