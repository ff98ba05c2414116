"""Label prompts: how a label-scoring job becomes the token ids the engine scores.

A label is scored by the log-probability the model gives its tokens right
after the prompt, so *which* prompt and *which* tokens decide whether the
scores mean anything. On SmolLM2-135M-Instruct the same 240 documents
(``benchmarks/data/topics.jsonl``) go from 36 % right as a plain
continuation to 69 % in the chat form with calibration, 76 % with two worked
examples per class (``benchmarks/classify_accuracy.py`` measures every form).

Two forms (``label_prompt``):

* ``plain``: the job's prompt text, then the label text, as one continuation.
* ``chat``: the prompt (as one user message) or the job's messages, rendered
  with the model's chat template and its generation prompt; the label is the
  assistant's answer. Instruct models are trained to answer there.

Labels are tokenized the way the model would write them after the prompt:
the prompt text and the label text are encoded *together*, and the label's
tokens are what follows the prompt's tokens. Where a merge crosses the
boundary (a prompt ending in a space before a word label: ``"is: "`` +
``"sports"`` encodes as ``"is:"``, ``" sports"``) the boundary moves back to
the longest token prefix every label shares with the prompt, so each label is
scored as exactly the tokens the model would produce, never as a label
encoded alone and glued on.

Few-shot examples are prior turns (chat: a user turn with the example's text,
then an assistant turn with its label, after any leading system messages) or
prior blocks (plain: ``text + label`` and a blank line). Their text goes in as
given, so a client fills it from the same template as its documents.

Calibration (``calibrate``): the same prompt with the document replaced by a
content-free input (``calibration_input``, default ``"N/A"``; it replaces the
prompt, or the content of the last user message) is scored once per label set
and form, and each label's score on it is subtracted from the document's
before the softmax. That removes the model's prior preference for some labels
(Zhao et al. 2021, "Calibrate before use"). The content-free request built here
is an ordinary label request, so the worker scores it with the engine and
caches the result under :meth:`LabelTokens.identity`.

``first`` normalization scores each label by its first token only; the
labels are cut to that token here (so the engine does no more work), and
labels that share their first token are refused, since they would tie.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

LABEL_PROMPTS = ("plain", "chat")
DEFAULT_LABEL_PROMPT = "plain"  # a job that names no form: its prompt continued, as before the field existed
DEFAULT_CALIBRATION_INPUT = "N/A"
MAX_FEW_SHOT = 32


class LabelPromptError(ValueError):
    """The job's labels cannot be scored in the form it asks for; the message
    names the field and value (the worker answers ``invalid_request``)."""


@dataclasses.dataclass(frozen=True)
class FewShot:
    """One worked example: a user turn's text and the label that answers it."""

    text: str
    label: str


@dataclasses.dataclass(frozen=True)
class LabelRequest:
    """What a label-scoring job asks for, in terms of text."""

    labels: tuple[str, ...]
    prompt: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    form: str = DEFAULT_LABEL_PROMPT
    few_shot: tuple[FewShot, ...] = ()
    first_token_only: bool = False

    def content_free(self, calibration_input: str = DEFAULT_CALIBRATION_INPUT) -> LabelRequest:
        """The same request with the document replaced by ``calibration_input``:
        the prompt, or the content of the last user message."""
        if self.messages is None:
            return dataclasses.replace(self, prompt=calibration_input)
        messages = [dict(m) for m in self.messages]
        for m in reversed(messages):
            if m.get("role") == "user":
                m["content"] = calibration_input
                break
        else:
            raise LabelPromptError(
                "calibrate: the messages have no user message whose content a content-free input could replace"
            )
        return dataclasses.replace(self, messages=tuple(messages))


@dataclasses.dataclass(frozen=True)
class LabelTokens:
    """The engine's inputs: one prompt, and each label's tokens after it."""

    prompt_ids: list[int]
    label_ids: list[list[int]]

    def identity(self) -> str:
        """A hash of the token ids: the calibration cache's key (the same
        content-free prompt and labels always score the same)."""
        return hashlib.sha256(orjson.dumps([self.prompt_ids, self.label_ids])).hexdigest()[:40]


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except TypeError:  # a tokenizer without the flag (tests' byte tokenizer) adds no specials
        return list(tokenizer.encode(text))


def chat_messages(request: LabelRequest) -> list[dict[str, Any]]:
    """The conversation a chat-form request renders: leading system messages,
    the few-shot turns, then the job's own turns (its prompt as one user
    message)."""
    own = (
        [dict(m) for m in request.messages]
        if request.messages is not None
        else [{"role": "user", "content": request.prompt or ""}]
    )
    lead = 0
    while lead < len(own) and own[lead].get("role") == "system":
        lead += 1
    shots: list[dict[str, Any]] = []
    for shot in request.few_shot:
        shots += [{"role": "user", "content": shot.text}, {"role": "assistant", "content": shot.label}]
    return own[:lead] + shots + own[lead:]


def render(tokenizer: Any, request: LabelRequest) -> tuple[str, bool]:
    """The text every label follows, and whether encoding it adds the
    tokenizer's specials (plain text does; a chat template writes its own)."""
    if request.form == "chat":
        return tokenizer.apply_chat_template(chat_messages(request), add_generation_prompt=True), False
    if request.messages is not None:
        raise LabelPromptError(
            "label_prompt: 'plain' scores a continuation of a prompt; a job with messages uses 'chat'"
        )
    shots = "".join(f"{shot.text}{shot.label}\n\n" for shot in request.few_shot)
    return shots + (request.prompt or ""), True


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = seqs[0][i]
        if any(s[i] != t for s in seqs[1:]):
            return i
    return n


def tokenize(
    tokenizer: Any, text: str, labels: Sequence[str], *, add_special_tokens: bool, first_token_only: bool = False
) -> LabelTokens:
    """Each label's tokens as the model would write them after ``text``
    (see the module docstring): ``text + label`` encoded whole, split where
    the prompt's own tokens and every label's encoding stop agreeing."""
    prompt_ids = _encode(tokenizer, text, add_special_tokens)
    fulls = [_encode(tokenizer, text + label, add_special_tokens) for label in labels]
    cut = _common_prefix([prompt_ids, *fulls])
    if cut == 0:
        raise LabelPromptError("the prompt is empty: labels need a prompt to follow")
    label_ids = [full[cut:] for full in fulls]
    for label, ids in zip(labels, label_ids):
        if not ids:
            raise LabelPromptError(f"labels: {label!r} adds no tokens after the prompt")
    if first_token_only:
        label_ids = [ids[:1] for ids in label_ids]
        seen: dict[int, str] = {}
        for label, ids in zip(labels, label_ids):
            if ids[0] in seen:
                raise LabelPromptError(
                    f"label_normalization: 'first' cannot tell {seen[ids[0]]!r} from {label!r}: both start with the same token"
                )
            seen[ids[0]] = label
    return LabelTokens(prompt_ids[:cut], label_ids)


def prepare(tokenizer: Any, request: LabelRequest) -> LabelTokens:
    """A request's prompt and label token ids (raises :class:`LabelPromptError`)."""
    if request.form not in LABEL_PROMPTS:
        raise LabelPromptError(f"label_prompt must be one of {LABEL_PROMPTS}, got {request.form!r}")
    text, specials = render(tokenizer, request)
    return tokenize(
        tokenizer, text, request.labels, add_special_tokens=specials, first_token_only=request.first_token_only
    )


__all__ = [
    "DEFAULT_CALIBRATION_INPUT",
    "DEFAULT_LABEL_PROMPT",
    "FewShot",
    "LABEL_PROMPTS",
    "LabelPromptError",
    "LabelRequest",
    "LabelTokens",
    "MAX_FEW_SHOT",
    "chat_messages",
    "prepare",
    "render",
    "tokenize",
]
