"""What a result carries beyond its text: log-probabilities in OpenAI's
shapes, and the parsed JSON of a JSON-constrained job.

The worker writes ``logprobs`` in the chat completions shape for every job
(``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``,
the richer of OpenAI's two); an OpenAI Batch output line for
``/v1/completions`` gets the legacy shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) made from it (:func:`completion_logprobs`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TokenBytes = Callable[[int], bytes]


@functools.lru_cache(maxsize=8)
def _llg_tokenizer(tokenizer_json: str):
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json)


def token_bytes_for(tokenizer: Any) -> TokenBytes:
    """The exact bytes of one token id of a jaxserve ``Tokenizer``.

    llguidance's tokenizer maps ids to bytes for byte-level BPE and byte
    fallback alike (decoding one id as text would turn part of a UTF-8
    character into U+FFFD). Without a ``tokenizer.json`` on disk it falls
    back to the tokenizer's own decode."""
    path = getattr(tokenizer, "path", None)
    if path is not None and (Path(path) / "tokenizer.json").is_file():
        tok = _llg_tokenizer(str(Path(path) / "tokenizer.json"))
        return lambda token_id: bytes(tok.decode_bytes([int(token_id)]))
    return lambda token_id: tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")


def _entry(token_id: int, logprob: float, token_bytes: TokenBytes) -> dict[str, Any]:
    raw = token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": float(logprob), "bytes": list(raw)}


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    token_bytes: TokenBytes,
) -> dict[str, Any]:
    """OpenAI's chat ``choices[].logprobs``: one entry per completion token
    (``top_logprobs`` empty when none were asked for)."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        entry = _entry(token_id, logprob, token_bytes)
        alternatives = top[i] if top is not None and i < len(top) else ()
        entry["top_logprobs"] = [_entry(t, lp, token_bytes) for t, lp in alternatives]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(chat: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's legacy completions ``choices[].logprobs`` from the chat shape."""
    content = chat.get("content") or []
    tokens = [c["token"] for c in content]
    offsets, at = [], 0
    for c in content:
        offsets.append(at)
        at += len(bytes(c["bytes"]).decode("utf-8", errors="replace"))
    top = None
    if any(c.get("top_logprobs") for c in content):
        top = [{t["token"]: t["logprob"] for t in c.get("top_logprobs") or ()} for c in content]
    return {
        "tokens": tokens,
        "token_logprobs": [c["logprob"] for c in content],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def parsed_json(kind: str | None, text: str, finish_reason: str | None) -> Any:
    """The parsed output of a JSON-constrained job that ended on its own
    (``None`` for other jobs, or a text cut by length)."""
    if kind not in ("json_schema", "json_object") or finish_reason != "stop":
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
