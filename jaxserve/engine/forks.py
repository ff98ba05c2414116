"""Label scoring's side of the scheduler: parked prompts and their forks.

A scoring job (``Engine.add_score_request``) is a prefill-only parent whose
prompt is computed once, then one fork per label that continues it. When the
parent's prompt is computed it is *parked*: it keeps its KV blocks, its
forks become known to the scheduler, and each step starts as many of them
as sequence slots and blocks allow. A fork shares the parent's full blocks
and gets its own copy of the partial last block (a ``block_copies`` entry of
the next plan). Kept apart from the planning rules because nothing else in
the scheduler forks; tests: ``tests/test_scheduler_forks.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.types import RequestClass
from jaxserve.request_error import RequestError

if TYPE_CHECKING:
    from jaxserve.engine.scheduler import Scheduler


class ForkTable:
    """The scheduler's parked parents (oldest first) and the block copies
    queued for the next plan. Its methods act on the scheduler that owns it
    (they move requests between its queues)."""

    def __init__(self) -> None:
        self.parked: list[Request] = []  # prefill-only requests with forks still to start
        self.copies: list[tuple[int, int]] = []  # (source, destination) block copies for the next plan

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies for the plan being built; the table starts afresh."""
        copies, self.copies = self.copies, []
        return copies

    def start(self, sched: Scheduler) -> None:
        """Start the forks of parked requests while sequence slots and blocks
        allow, oldest parent first. A fork begins running at its parent's
        computed tokens: it references the parent's full blocks and gets its
        own copy of the partial last block (queued in ``copies``, made by the
        runner before the step's forward). A parent whose forks have all
        started is finished, releasing its references."""
        cfg = sched.config
        while self.parked:
            parent = self.parked[0]
            computed = parent.num_computed_tokens
            full, partial = divmod(computed, sched.block_size)
            shared = parent.block_ids[:full]
            while parent.fork_children:
                child = parent.fork_children[0]
                limit = cfg.max_num_seqs - (
                    cfg.interactive_reserved_seqs if child.request_class == RequestClass.BATCH else 0
                )
                if len(sched.running) >= limit:
                    return
                new: list[int] = []
                if partial:
                    if sched.free_blocks_for(child) < 1:
                        return
                    new = sched.allocator.allocate(1) or []
                    if not new:
                        return
                    self.copies.append((parent.block_ids[full], new[0]))
                parent.fork_children.pop(0)
                sched.allocator.touch(shared)
                child.block_ids = shared + new
                child.num_computed_tokens = computed
                child.num_registered_blocks = min(full, parent.num_registered_blocks)
                child.status = RequestStatus.RUNNING
                child.first_scheduled_time = time.monotonic()
                sched.running.append(child)
            sched.finish_request(parent.request_id, RequestStatus.FINISHED_STOPPED)  # leaves parked

    def park(self, sched: Scheduler, req: Request) -> None:
        """A prefill-only request computed its prompt: register its forks
        with the scheduler and keep its blocks until they have all started."""
        sched.running.remove(req)
        req.status = RequestStatus.PARKED
        for child in req.fork_children:
            if child.request_id in sched.requests:
                raise RequestError("invalid_request", f"duplicate request id {child.request_id!r}")
            if child.all_token_ids[: req.num_tokens] != req.all_token_ids:
                raise ValueError(f"fork {child.request_id!r} does not continue {req.request_id!r}'s tokens")
            sched.register(child)
        self.parked.append(req)

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
