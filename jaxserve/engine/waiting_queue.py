"""The waiting line of one request class (``Scheduler``'s admission order)."""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterator

from jaxserve.engine.request import Request


class WaitingQueue:
    """One class's waiting requests: arrival order (``fcfs``) or a heap by
    (priority, arrival) (``priority``). Under fcfs a preempted request goes
    to the front; under priority it regains its place by its own key, which
    ranks it ahead of every later arrival of the same priority."""

    def __init__(self, policy: str) -> None:
        self._policy = policy
        self._fifo: collections.deque[Request] = collections.deque()
        self._heap: list[tuple[tuple, Request]] = []

    def __len__(self) -> int:
        return len(self._fifo) if self._policy == "fcfs" else len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        if self._policy == "fcfs":
            return iter(list(self._fifo))
        return iter([r for _, r in sorted(self._heap, key=lambda e: e[0])])

    def push(self, req: Request) -> None:
        if self._policy == "fcfs":
            self._fifo.append(req)
        else:
            heapq.heappush(self._heap, (req.sort_key("priority"), req))

    def push_front(self, req: Request) -> None:
        if self._policy == "fcfs":
            self._fifo.appendleft(req)
        else:
            self.push(req)

    def peek(self) -> Request:
        return self._fifo[0] if self._policy == "fcfs" else self._heap[0][1]

    def pop(self) -> Request:
        if self._policy == "fcfs":
            return self._fifo.popleft()
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        if self._policy == "fcfs":
            self._fifo.remove(req)
            return
        for i, (_, r) in enumerate(self._heap):
            if r is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{req.request_id!r} is not waiting")
