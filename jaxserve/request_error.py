"""The one error a request is refused or ended with, by the engine or at the
door (the wire's ``parse_job``, the worker's prompt rendering, the gateway).

Its ``code`` is one of the queue contract's public error codes
(``jaxserve.wire.errors.ERROR_CODES``), so every layer forwards it as it
is. It lives below both the wire and the engine, which raise it, and
imports nothing of either.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request the engine refuses. ``code`` is one of the public error codes
    of the queue contract (``invalid_request``, ``context_length_exceeded``,
    ``overloaded``, ...), so the worker can forward it unchanged."""

    def __init__(self, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable

    def __reduce__(self) -> tuple:
        # Crosses the worker's engine process boundary as it is (pickle
        # would otherwise call __init__ with the message alone).
        return (_request_error, (self.code, self.message, self.retryable))


def _request_error(code: str, message: str, retryable: bool) -> RequestError:
    return RequestError(code, message, retryable=retryable)
