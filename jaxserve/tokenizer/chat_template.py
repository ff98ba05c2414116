"""Chat template rendering compatible with transformers' ``apply_chat_template``.

Templates come from model repositories and are untrusted code, so they run in
Jinja's immutable sandbox. The environment mirrors the one transformers sets
up: ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, the
``raise_exception`` and ``strftime_now`` globals, and a ``tojson`` filter
that does not HTML-escape and keeps non-ASCII text as is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template is missing, is not valid Jinja, or failed while rendering."""


# ----------------------------------------------------------------- environment


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictFactory:
    """Stands in for the ``dict`` global: callable like ``dict`` but exposes no
    class internals to the template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _GuardedNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _GuardedNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key: str, value: Any) -> None:
        _GuardedNamespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with an underscore: {key!r}")


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _GuardedNamespace
    return env


@functools.lru_cache(maxsize=64)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile (and cache) a template; syntax errors become ChatTemplateError."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template must be a string, got {type(template).__name__}")
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc


# ------------------------------------------------------------------ inputs


def _plain(value: Any) -> Any:
    """A copy built only from JSON-like types, so templates never see rich objects
    (whose methods the sandbox would not know to block) nor the caller's data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check ``messages`` is a non-empty list of ``{"role", "content"}`` dicts and
    return a plain-data copy with None-valued keys dropped (as transformers does).

    ``content`` may be a string or a list of content parts; it may be absent
    (or None) only on a message that carries ``tool_calls``.
    """
    if isinstance(messages, (str, bytes)) or isinstance(messages, Mapping):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got a {type(messages).__name__}")
    if not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty: a chat needs at least one message")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        elif not isinstance(message, Mapping) and callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        clean = {k: v for k, v in _plain(message).items() if v is not None}
        role = clean.get("role")
        if role is None:
            raise ValueError(f"messages[{i}] has no 'role'")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty string, got {role!r}")
        if "content" in clean:
            content = clean["content"]
            if not isinstance(content, (str, list, tuple)):
                raise ValueError(
                    f"messages[{i}]['content'] must be a string or a list of content parts, "
                    f"got {type(content).__name__}"
                )
            if isinstance(content, (list, tuple)):
                for j, part in enumerate(content):
                    if not isinstance(part, dict):
                        raise ValueError(
                            f"messages[{i}]['content'][{j}] must be a dict content part, got {type(part).__name__}"
                        )
        elif "tool_calls" not in clean:
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'")
        # Like transformers 5: a message's reasoning, under any of its names, is
        # also readable as `reasoning_content` and `thinking`.
        reasoning = next((clean[k] for k in _REASONING_FIELDS if k in clean), None)
        if reasoning is not None:
            clean = {"thinking": reasoning, **clean, "reasoning_content": reasoning}
        out.append(clean)
    return out


def _validate_dict_list(name: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of dicts, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise ValueError(f"{name}[{i}] must be a dict (a JSON schema), got {type(item).__name__}")
    return _plain(list(value))


def fold_system_message(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with a leading system message folded into the user
    message after it: ``system + "\n\n" + user`` with the user's text
    trimmed, which is what Gemma 3's own template renders (for the templates
    of a family that has no system role but refuses the message instead:
    Gemma 2's, which then renders the same text). None when the messages do
    not start with a system message and then a user message.

    A content given as parts: the system message's text parts, joined; the
    user message's first text part takes the prefix (a text part is
    inserted when it has none)."""
    chat = validate_messages(messages)
    if len(chat) < 2 or chat[0]["role"] != "system" or chat[1]["role"] != "user":
        return None
    system = chat[0].get("content", "")
    if not isinstance(system, str):
        system = "".join(str(p.get("text", "")) for p in system if p.get("type") == "text")
    prefix = system + "\n\n"
    user = dict(chat[1])
    content = user.get("content", "")
    if isinstance(content, str):
        user["content"] = prefix + content.strip()
    else:
        parts = [dict(p) for p in content]
        first = next((i for i, p in enumerate(parts) if p.get("type") == "text"), None)
        if first is None:
            parts.insert(0, {"type": "text", "text": prefix})
        else:
            parts[first]["text"] = prefix + str(parts[first].get("text", "")).strip()
        user["content"] = parts
    return [user, *chat[2:]]


# ------------------------------------------------------------------ render


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``template`` over ``messages``.

    Template variables: ``messages``, ``add_generation_prompt``, ``tools`` and
    ``documents`` (None when not given, as in transformers), plus ``kwargs``
    (bos_token, eos_token, or anything else the template reads).
    """
    if template is None:
        raise ChatTemplateError("no chat template given")
    compiled = compile_chat_template(template)
    chat = validate_messages(messages)
    variables = {k: _plain(v) for k, v in kwargs.items()}
    variables.update(
        messages=chat,
        tools=_validate_dict_list("tools", tools),
        documents=_validate_dict_list("documents", documents),
        add_generation_prompt=bool(add_generation_prompt),
    )
    try:
        return compiled.render(**variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template raised: {exc}") from exc
    except Exception as exc:  # template code failing on its inputs (e.g. str + list)
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
