"""The runs a worker holds, and how each is found.

By job key: one run per key (intake attaches a second delivery of a key
to its run; a cancel and the claim renewals find the run of theirs). By
engine request id: an engine output finds the run it belongs to (the id
is unique per run, so a late output of an aborted run finds nothing). And
each run's trace, ended when the run leaves. A run enters at intake and
leaves at its ending (``JobRun._leave``), only where it still serves its
key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from jaxserve.worker.tracing import JobTrace


class HeldRun(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def request_id(self) -> str: ...


R = TypeVar("R", bound=HeldRun)
R_co = TypeVar("R_co", covariant=True)


class RunsView(Protocol[R_co]):
    """The table as its readers see it (cancels and claim renewals find
    their runs; nothing else moves them)."""

    def get(self, key: str) -> R_co | None: ...

    def __iter__(self) -> Iterator[R_co]: ...


class RunTable(Generic[R]):
    def __init__(self) -> None:
        self._by_key: dict[str, R] = {}
        self._by_request: dict[str, R] = {}
        self._traces: dict[str, JobTrace] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._by_key.values()))

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def get(self, key: str) -> R | None:
        """The run serving ``key``."""
        return self._by_key.get(key)

    def add(self, run: R, trace: JobTrace | None) -> None:
        """A new key's run (the caller checked the key is not held)."""
        self._by_key[run.key] = run
        if trace is not None:
            self._traces[run.request_id] = trace

    def entered_engine(self, run: R) -> None:
        """The run's request is in the engine: its outputs find it."""
        self._by_request[run.request_id] = run

    def for_output(self, request_id: str) -> R | None:
        return self._by_request.get(request_id)

    def trace(self, run: R) -> JobTrace | None:
        return self._traces.get(run.request_id)

    def leave(self, run: R) -> JobTrace | None:
        """The run ended: it leaves the tables where it still serves its key;
        returns its trace, for the caller to end."""
        if self._by_key.get(run.key) is run:
            del self._by_key[run.key]
        if self._by_request.get(run.request_id) is run:
            del self._by_request[run.request_id]
        return self._traces.pop(run.request_id, None)

    @property
    def holds_nothing(self) -> bool:
        """No run, no engine request and no trace left (what every ending
        must leave behind; ``tests/test_job_run.py``)."""
        return not (self._by_key or self._by_request or self._traces)
