"""Structured output: token masks from grammars, computed on the host.

A request with ``SamplingParams.structured`` (a JSON Schema, any JSON
object, a regular expression, a choice among strings, or a Lark grammar)
gets a :class:`Constraint`: an llguidance matcher that knows which tokens
may come next. Before each step that samples for the request, the engine
asks it for the row's bitmask (:meth:`Constraint.fill_mask`); the sampler
applies the mask on the device (``jaxserve.engine.sampler.apply_token_mask``).

Why llguidance: MIT, maintained, computes a mask in tens of microseconds at
a 128k vocabulary (an Earley parser over a token trie, no per-schema
automaton to build), and covers JSON Schema, regex and Lark with one
matcher API; its bitmask layout (int32 words, bit ``v % 32`` of word
``v // 32``) is the one the sampler unpacks.

The matcher follows the request's output tokens rather than being told
about each token: ``fill_mask`` is given the request's whole output so far
and catches up (it feeds the new tokens, and when the output was cut back,
by preemption or a recomputed failed step, it starts again from a fresh
matcher and replays the kept tokens). So no code path that adds, drops or
recomputes tokens has to remember the matcher.

A grammar compiles once per distinct constraint (:class:`StructuredBackend`
keeps the validated grammar and a pristine matcher, copied per request). A
constraint the library refuses raises ``RequestError('invalid_request')``
naming the problem at admission; a matcher that fails later (a token it
cannot accept) records :attr:`Constraint.error`, lets the row through
unmasked, and the engine fails that request alone.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from jaxserve.request_error import RequestError
from jaxserve.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

#: distinct constraints whose compiled grammar is kept
GRAMMAR_CACHE_SIZE = 512
#: JSON options: compact JSON (no free whitespace), so that a sampled
#: object cannot run on with blanks until max_tokens; a schema's own
#: ``x-guidance`` settings win
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


def json_schema_constraint(schema: dict | str) -> StructuredOutput:
    """A ``json_schema`` constraint from a schema (a dict or JSON text), as
    compact JSON text so that equal schemas share one compiled grammar. Keys
    keep their order: properties are generated in the schema's order."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RequestError("invalid_request", f"the JSON Schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise RequestError("invalid_request", f"a JSON Schema must be an object, got {type(schema).__name__}")
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def lark_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar text of a constraint (not yet validated)."""
    import llguidance

    m = llguidance.LLMatcher
    text = cast(str, spec.value)  # every kind but "choice" holds text
    if spec.kind == "json_schema":
        try:
            return m.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as exc:
            raise RequestError("invalid_request", f"the JSON Schema is refused: {exc}") from None
    if spec.kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return m.grammar_from_regex(text)
    if spec.kind == "choice":
        # Lark string literals take JSON's escapes.
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
    if spec.kind == "grammar":
        return m.grammar_from_lark(text)
    raise RequestError("invalid_request", f"unknown structured output kind {spec.kind!r}")


_WHAT = {
    "json_schema": "the JSON Schema",
    "json_object": "json_object",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "the grammar",
}


class StructuredBackend:
    """The model's llguidance tokenizer and the compiled grammars, one per
    engine. Built lazily: an engine that never sees a constrained request
    never loads llguidance."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_json = str(tokenizer_json)
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        #: int32 words of one row's mask (the sampler's ``mask_words(vocab)``)
        self.num_words = -(-self.vocab_size // 32)
        self._tokenizer = None
        self._tokenizer_words = 0
        self._cache: collections.OrderedDict[StructuredOutput, object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self.num_compiled = 0  # distinct grammars compiled (the cache's misses)
        self._executor: llguidance.LLExecutor | None = None  # llguidance's parallel mask filler (fill_masks)

    def prepare(self) -> None:
        """Build llguidance's tokenizer now (seconds at a 49k vocabulary on a
        busy CPU) rather than under the first constrained request, which
        would hold every other request's step; ``Engine.warmup`` starts it
        on a thread of its own. A failure here is left for that request."""
        try:
            self._llg_tokenizer()
        except Exception:  # noqa: BLE001 - raised again, to the request, by _llg_tokenizer
            pass

    def _llg_tokenizer(self):
        with self._tokenizer_lock:
            return self._build_tokenizer()

    def _build_tokenizer(self):
        if self._tokenizer is None:
            import llguidance

            tok = llguidance.LLTokenizer(self.tokenizer_json, eos_token=self.eos_token_ids or None)
            words = -(-tok.vocab_size // 32)
            if words > self.num_words:
                raise RuntimeError(
                    f"the tokenizer has {tok.vocab_size} tokens, more than the model's vocabulary of {self.vocab_size}"
                )
            self._tokenizer, self._tokenizer_words = tok, words
        return self._tokenizer

    def compile(self, spec: StructuredOutput):
        """The pristine matcher of a constraint, compiled on first use and
        cached; raises ``RequestError('invalid_request')`` naming what the
        library refused."""
        spec.validate()
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        import llguidance

        tok = self._llg_tokenizer()
        grammar = lark_grammar(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error and not error.startswith("WARNING"):
            raise RequestError("invalid_request", f"{_WHAT[spec.kind]} is refused: {error.strip()}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError("invalid_request", f"{_WHAT[spec.kind]} is refused: {matcher.get_error()}")
        with self._lock:
            self._cache[spec] = matcher
            self.num_compiled += 1
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def fill_masks(self, items: Sequence[tuple[Constraint, Sequence[int]]]) -> np.ndarray:
        """The masks of a step's constrained rows at once: ``[len(items),
        num_words]`` int32, row ``i`` for ``items[i] = (constraint, its
        request's output so far)``. Each matcher first catches up with its
        output (:meth:`Constraint.catch_up`); the masks are then computed
        by llguidance's executor on its thread pool, all rows in parallel
        (one at a time, a 64-row batch of a 49k vocabulary spends
        milliseconds per step inside JSON strings)."""
        out = np.full((len(items), self.num_words), -1, np.int32)
        live = []
        for i, (constraint, tokens) in enumerate(items):
            constraint.catch_up(tokens)
            if constraint.error is None:
                live.append((i, constraint))
        if not live:
            return out
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        words = self._tokenizer_words
        buf = np.zeros((len(live), words), np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(c.matcher, j) for j, (_, c) in enumerate(live)], buf.ctypes.data, words * 4, len(live)
        )
        for j, (i, constraint) in enumerate(live):
            if constraint.matcher.is_error():
                constraint.error = f"structured output failed: {constraint.matcher.get_error()}"
                continue
            out[i, :words] = buf[j]
            out[i, words:] = 0
        return out

    def fill_draft_masks(self, items: Sequence[tuple[Constraint, Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """Speculative decoding: for each ``(constraint, its request's output
        so far, guessed tokens)``, the masks after each guess, ``[len(guesses),
        num_words]``: what :meth:`fill_masks` gives once the guesses are
        output. llguidance's executor advances each matcher through the
        guesses and rolls it back, all rows in parallel. The guesses were
        checked against the grammar when proposed
        (``jaxserve.engine.speculative``); were one refused, the masks from
        there on would allow nothing, and no sample there is ever kept (the
        refused guess cannot equal the sample before it)."""
        out = [np.zeros((len(drafts), self.num_words), np.int32) for _, _, drafts in items]
        live = []
        for i, (constraint, tokens, drafts) in enumerate(items):
            constraint.catch_up(tokens)
            if constraint.error is None and drafts:
                live.append((i, constraint, [int(t) for t in drafts]))
        if not live:
            return out
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        words = self._tokenizer_words
        at = []
        total = 0
        for _, _, drafts in live:
            at.append(total)
            total += 1 + len(drafts)
        buf = np.zeros((total, words), np.int32)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            [(c.matcher, start, drafts) for start, (_, c, drafts) in zip(at, live)], buf.ctypes.data, words * 4, total
        )
        for start, (i, constraint, drafts) in zip(at, live):
            if constraint.matcher.is_error():
                constraint.error = f"structured output failed: {constraint.matcher.get_error()}"
                continue
            out[i][:, :words] = buf[start + 1 : start + 1 + len(drafts)]
        return out

    def start(self, spec: StructuredOutput) -> Constraint:
        """A request's constraint (its own copy of the compiled matcher)."""
        return Constraint(self.compile(spec), self.num_words, self._tokenizer_words)


@dataclasses.dataclass
class Constraint:
    """One request's matcher and the output tokens it has consumed."""

    pristine: llguidance.LLMatcher  # the cached, never advanced matcher
    num_words: int
    tokenizer_words: int
    error: str | None = None

    def __post_init__(self) -> None:
        self._matcher = self.pristine.deep_copy()
        self._fed: list[int] = []

    @property
    def num_consumed(self) -> int:
        return len(self._fed)

    @property
    def matcher(self):
        """The llguidance matcher, advanced to the output consumed so far."""
        return self._matcher

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        """Bring the matcher to ``output_token_ids`` (the request's whole
        output so far); a token it cannot accept records :attr:`error`."""
        if self.error is not None:
            return
        n = len(self._fed)
        if len(output_token_ids) < n or list(output_token_ids[:n]) != self._fed:
            # output cut back (preemption, a recomputed step): replay from scratch
            self._matcher = self.pristine.deep_copy()
            self._fed = []
            n = 0
        for token in output_token_ids[n:]:
            token = int(token)
            if token < 0:
                raise RuntimeError("a constrained request's last token is still on the device")
            if not self._matcher.consume_token(token):
                self.error = f"structured output failed at output token {len(self._fed)} (id {token}): " + (
                    self._matcher.get_error() or "the grammar does not accept it"
                )
                return
            self._fed.append(token)

    def fill_mask(self, output_token_ids: Sequence[int]) -> np.ndarray:
        """The bitmask (int32 ``[num_words]``) of the tokens allowed after
        ``output_token_ids`` (the request's whole output so far), for one
        row (``StructuredBackend.fill_masks`` does a step's rows at once).
        After an error, every token is allowed (the engine fails the request
        when it sees :attr:`error`)."""
        self.catch_up(output_token_ids)
        row = np.zeros(self.num_words, np.int32)
        if self.error is not None:
            row[:] = -1
            return row
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, self.tokenizer_words * 4)
        if self._matcher.is_error():
            self.error = f"structured output failed: {self._matcher.get_error()}"
            row[:] = -1
        return row

    @property
    def is_accepting(self) -> bool:
        """Whether the output consumed so far is complete under the grammar."""
        return self.error is None and self._matcher.is_accepting()
