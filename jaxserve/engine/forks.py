"""Label scoring's side of the scheduler: parked prompts and their forks.

A scoring job (``Engine.add_score_request``) is a prefill-only parent whose
prompt is computed once, then one fork per label that continues it. When the
parent's prompt is computed it is *parked*: it keeps its KV blocks, its
forks become known to the scheduler, and each step starts as many of them
as sequence slots and blocks allow. A fork shares the parent's full blocks
and gets its own copy of the partial last block (a ``block_copies`` entry of
the next plan). This table keeps the books (which parents are parked,
which fork starts next, the block copies the next plan makes); the
scheduler moves the requests themselves, between its running list and its
block tables, as it moves every other request (``Scheduler._park``,
``Scheduler._start_forks``). Kept apart from the planning rules because
nothing else in the scheduler forks; tests: ``tests/test_scheduler_forks.py``.
"""

from __future__ import annotations

from jaxserve.engine.request import Request, RequestStatus


class ForkTable:
    """The scheduler's parked parents (oldest first) and the block copies
    queued for the next plan."""

    def __init__(self) -> None:
        self.parked: list[Request] = []  # prefill-only requests with forks still to start
        self.copies: list[tuple[int, int]] = []  # (source, destination) block copies for the next plan

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies for the plan being built; the table starts afresh."""
        copies, self.copies = self.copies, []
        return copies

    def park(self, req: Request) -> list[Request]:
        """A prefill-only request computed its prompt: it waits here, keeping
        its blocks, until its forks have all started; returns the forks, for
        the scheduler to make known. Each must continue its tokens."""
        for child in req.fork_children:
            if child.all_token_ids[: req.num_tokens] != req.all_token_ids:
                raise ValueError(f"fork {child.request_id!r} does not continue {req.request_id!r}'s tokens")
        self.parked.append(req)
        return list(req.fork_children)

    def next_fork(self) -> tuple[Request, Request | None] | None:
        """The oldest parked parent and its next fork to start (None when
        all of them have started: the parent can end), or None when nothing
        is parked."""
        if not self.parked:
            return None
        parent = self.parked[0]
        return parent, parent.fork_children[0] if parent.fork_children else None

    def started(self, parent: Request, child: Request, copy: tuple[int, int] | None) -> None:
        """``child``, ``parent``'s next fork, is running; ``copy``: its own
        copy of the parent's partial last block ``(source, destination)``,
        for the next plan to make before its forward."""
        parent.fork_children.remove(child)
        if copy is not None:
            self.copies.append(copy)

    def unpark(self, req: Request, status: RequestStatus) -> list[str]:
        """A parked parent ends: the forks that never started end with it
        (``status``); returns their ids, for the scheduler to forget."""
        self.parked.remove(req)
        dropped = []
        for child in req.fork_children:
            dropped.append(child.request_id)
            child.status = status
        req.fork_children = []
        return dropped

    def unfork(self, req: Request) -> bool:
        """Drop a fork that has not started yet from its parked parent."""
        for parent in self.parked:
            if req in parent.fork_children:
                parent.fork_children.remove(req)
                return True
        return False
