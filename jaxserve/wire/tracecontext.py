"""W3C Trace Context on AMQP messages: ``traceparent`` and ``tracestate``
headers, read by the worker and written by producers.

The worker continues a producer's trace from these two headers
(``jaxserve.worker.tracing``); producers (``jaxserve.client``, ``jaxserve
submit``, ``jaxserve batch``) write them only while a trace is active: an
OpenTelemetry span current in the caller, or the ``TRACEPARENT`` /
``TRACESTATE`` environment variables a traced parent process hands to a
command (OpenTelemetry's environment-variable carrier). They never invent
one: a made-up ``traceparent`` names a parent span that no backend ever
receives (a broken tree), and its unsampled flag would tell a parent-based
sampler to drop the job's spans; a worker that traces starts a root trace
of its own instead, and the result carries that trace id
(``docs/protocol.md``, "Tracing").

Nothing here imports OpenTelemetry: an active span can only exist if the
application already imported ``opentelemetry.trace``, so that module is
looked up in ``sys.modules``, never imported (no cost for producers that do
not trace).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_HEX = re.compile(r"[0-9a-f]+\Z")
# W3C: at most 32 list members; 512 characters is the size every vendor must
# propagate, so longer values are dropped rather than cut mid-member.
_MAX_TRACESTATE = 512


@dataclasses.dataclass(frozen=True)
class TraceParent:
    """A parsed ``traceparent`` (version 00 fields) with its ``tracestate``."""

    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero: the producer's span
    flags: int  # trace-flags; bit 0 is "sampled"
    tracestate: str | None = None

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    def headers(self) -> dict[str, str]:
        out = {TRACEPARENT: self.header()}
        if self.tracestate:
            out[TRACESTATE] = self.tracestate
        return out


def _text(value: Any) -> str | None:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _hex_id(value: str, width: int) -> bool:
    return len(value) == width and _HEX.match(value) is not None and value.strip("0") != ""


def parse_traceparent(value: Any, tracestate: Any = None) -> TraceParent | None:
    """The header's fields, or None when it is absent or malformed (W3C:
    a receiver that cannot parse ``traceparent`` starts a new trace and
    ignores ``tracestate``). Versions above 00 are read by their first four
    fields, as the specification asks; version ff is invalid."""
    text = _text(value)
    if text is None:
        return None
    text = text.strip()
    if len(text) < 55 or (len(text) > 55 and text[55] != "-"):
        return None
    version, trace_id, span_id, flags = text[:2], text[3:35], text[36:52], text[53:55]
    if text[2] != "-" or text[35] != "-" or text[52] != "-":
        return None
    if not (len(version) == 2 and _HEX.match(version)) or version == "ff" or (version == "00" and len(text) != 55):
        return None
    if not (_hex_id(trace_id, 32) and _hex_id(span_id, 16) and _HEX.match(flags)):
        return None
    state = _text(tracestate)
    if state is not None:
        state = state.strip()
        if not state or len(state) > _MAX_TRACESTATE:
            state = None
    return TraceParent(trace_id, span_id, int(flags, 16), state)


def from_headers(headers: Mapping[str, Any] | None) -> TraceParent | None:
    """The trace context an AMQP message carries, or None."""
    if not headers:
        return None
    value = headers.get(TRACEPARENT)
    if value is None:
        return None
    return parse_traceparent(value, headers.get(TRACESTATE))


def active() -> TraceParent | None:
    """The caller's active trace: the current OpenTelemetry span when the
    application uses OpenTelemetry and one is current, else the
    ``TRACEPARENT`` / ``TRACESTATE`` environment variables, else None."""
    otel = sys.modules.get("opentelemetry.trace")
    if otel is not None:
        ctx = otel.get_current_span().get_span_context()
        if ctx.is_valid:
            state = ctx.trace_state.to_header() if ctx.trace_state else None
            return TraceParent(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", int(ctx.trace_flags), state or None)
    return parse_traceparent(os.environ.get("TRACEPARENT"), os.environ.get("TRACESTATE"))
