"""Streaming detokenization that never splits a UTF-8 character.

Decoding one token at a time is wrong in two ways: a character may span
tokens (byte-level BPE pieces, SentencePiece ``<0xF0>`` byte-fallback tokens)
so a lone token decodes to U+FFFD, and SentencePiece decoders strip the
leading space of the first token they see, so "▁world" alone decodes to
"world" instead of " world".

The prefix/read offset technique fixes both. ``tokens[prefix:read]`` is a
small window of already-emitted context and ``tokens[read:]`` the tokens not
emitted yet. Each step decodes ``tokens[prefix:]`` and, if it grew past the
decoded context and does not end in U+FFFD (an unfinished character), emits
the new suffix; emitted tokens then serve as context. When the window passes
``_MAX_WINDOW`` tokens it restarts at the read offset, and at most
``_MAX_PENDING`` tokens are ever held back, so the window stays under about
40 tokens and streaming costs O(1) per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as context for the first generated token (enough for
# leading-space handling and multi-token merges; vLLM uses the same 5). The
# start is moved back, at most _MAX_BACKOFF tokens, off the middle of a
# character.
_INITIAL_CONTEXT = 5
_MAX_BACKOFF = 6
# A valid UTF-8 character spans at most 4 bytes, hence at most 4 non-special
# tokens. Past this many held-back tokens the stream is not valid UTF-8 (or is
# a run of tokens that decode to nothing): emit what decode() gives, U+FFFD
# included, rather than hold text back forever and grow the window.
_MAX_PENDING = 12
# Once the window is longer than this, its start moves up to the read offset
# (read offsets are the cut points known to sit between whole characters).
# Between rebases decode() runs once per token.
_MAX_WINDOW = 24


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _special_ids(tokenizer: object) -> frozenset[int]:
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is not None:
        return frozenset(ids)
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if callable(added):  # a bare tokenizers.Tokenizer
        return frozenset(i for i, token in added().items() if token.special)
    return frozenset()


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    ``prompt_ids`` gives context for the first generated tokens (without it, a
    SentencePiece tokenizer drops the leading space of the first generated
    word, exactly as ``decode(generated_ids)`` would). With no prompt the
    concatenated deltas, flush() included, equal
    ``tokenizer.decode(all_pushed_ids)``.
    """

    __slots__ = (
        "_tokenizer",
        "_skip",
        "_window",
        "_read",
        "_prefix_text",
        "_pieces",
        "_text_cache",
        "_num_tokens",
        "_skip_ids",
    )

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        # Decode straight through the `tokenizers` object when given our wrapper.
        backend = getattr(tokenizer, "backend", None)
        self._tokenizer = backend if backend is not None and hasattr(backend, "decode") else tokenizer
        self._skip = skip_special_tokens
        # decode(skip_special_tokens=True) drops special tokens before decoding,
        # so leaving them out of the window changes nothing and keeps long runs
        # of them (common from random-weight models) from filling it.
        self._skip_ids: frozenset[int] = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        # The window holds the ids from the prefix offset on. ``_read`` (relative
        # to the window) is the read offset: ids before it are emitted (or are
        # prompt) and decode to ``_prefix_text``.
        self._window: list[int] = self._initial_context(prompt_ids)
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window) if self._window else ""
        self._pieces: list[str] = []
        self._text_cache: str | None = ""
        self._num_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _initial_context(self, prompt_ids: Iterable[int] | None) -> list[int]:
        if prompt_ids is None:
            return []
        tail = list(prompt_ids)[-(_INITIAL_CONTEXT + _MAX_BACKOFF) :]
        start = max(len(tail) - _INITIAL_CONTEXT, 0)
        # A window starting inside a character decodes to a leading U+FFFD (and a
        # byte-fallback decoder garbles the whole byte run): start earlier.
        while start > 0 and self._decode(tail[start:]).startswith(REPLACEMENT_CHAR):
            start -= 1
        return tail[start:]

    def _emit(self, new_text: str) -> str:
        """Emit what ``new_text`` (the decoded window) adds beyond the emitted
        context; the whole window becomes context."""
        prefix_len = len(self._prefix_text)
        delta = new_text[prefix_len:] if len(new_text) > prefix_len else ""
        window = self._window
        if len(window) > _MAX_WINDOW and self._read > 0:
            # Rebase the window on the read offset: read offsets sit between
            # whole characters, so decoding from there is clean.
            del window[: self._read]
            self._prefix_text = self._decode(window)
        else:
            self._prefix_text = new_text
        self._read = len(window)
        if delta:
            self._pieces.append(delta)
            self._text_cache = None
        return delta

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly "")."""
        token_id = int(token_id)
        self._num_tokens += 1
        if token_id in self._skip_ids:
            return ""
        self._window.append(token_id)
        new_text = self._decode(self._window)
        if len(self._window) - self._read <= _MAX_PENDING and (
            len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR)
        ):
            return ""
        return self._emit(new_text)

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join([self.push(t) for t in token_ids])

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character comes out as U+FFFD,
        as ``decode`` would give it)."""
        if len(self._window) == self._read:
            return ""
        return self._emit(self._decode(self._window))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            joined = "".join(self._pieces)
            self._pieces = [joined]
            self._text_cache = joined
        return self._text_cache

    @property
    def num_tokens(self) -> int:
        """Generated tokens pushed so far."""
        return self._num_tokens

    @property
    def pending_tokens(self) -> int:
        """Tokens pushed but not yet reflected in ``text``."""
        return len(self._window) - self._read

    @property
    def window_size(self) -> int:
        """Token ids the next push() decodes, minus one; bounded by a small constant."""
        return len(self._window)
