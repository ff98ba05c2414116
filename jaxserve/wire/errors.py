"""Error codes of the queue contract and whether retrying can help.

Every error result carries one of :data:`ERROR_CODES`. ``retryable`` tells a
producer whether resubmitting the same job (same key) later may succeed; the
worker itself also uses it: a retryable ``internal`` failure is given back to
the broker (nack + requeue) so ``x-delivery-limit`` dead-letters a job that
keeps failing, instead of answering it with an error it did not earn.
"""

from __future__ import annotations

ERROR_CODES: tuple[str, ...] = (
    "invalid_request",
    "context_length_exceeded",
    "unknown_model",
    "overloaded",
    "rate_limited",
    "expired",
    "cancelled",
    "internal",
    # The key already has a result for a *different* job body.
    "idempotency_key_reused",
)

# Retrying the same job later may succeed for these codes.
RETRYABLE_CODES: frozenset[str] = frozenset({"overloaded", "rate_limited", "internal"})


def is_retryable(code: str) -> bool:
    return code in RETRYABLE_CODES
