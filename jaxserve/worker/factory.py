"""Engine factories for ``jaxserve worker --engine MODULE:CALLABLE``, and
the check of ``--engine-arg KEY=VALUE`` against the one it names.

An engine argument is checked in the command, before anything is built: a
misspelt name or a value of the wrong kind used to surface as a traceback
from the engine's process, inside the worker's (``tests/test_cli_errors.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any


class EngineArgError(ValueError):
    """An ``--engine-arg`` the engine factory cannot take; the message names
    the argument and what it accepts."""


def load_factory(path: str) -> Callable[..., Any]:
    """``package.module:callable`` -> the callable."""
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--engine must look like 'package.module:callable', got {path!r}")
    module = importlib.import_module(mod_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path!r} is not callable")
    return obj


def build_from_path(path: str, kwargs: dict[str, Any]) -> Any:
    """``load_factory(path)(**kwargs)``. ``jaxserve worker`` hands the worker
    ``functools.partial(build_from_path, path, kwargs)``: a module-level
    function pickles, so the engine process can build the engine itself."""
    return load_factory(path)(**kwargs)


def _coerce(value: str) -> Any:
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def parse_engine_args(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg must be KEY=VALUE, got {item!r}")
        out[key.replace("-", "_")] = _coerce(value)
    return out


def _expected(tp: Any, value: Any) -> str | None:
    """None when ``value`` fits the annotation ``tp``; else what it accepts."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        wants = [_expected(a, value) for a in options]
        return None if any(w is None for w in wants) else " or ".join(w for w in wants if w)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        return None if value in allowed else "one of " + ", ".join(str(a) for a in allowed)
    if tp is bool:
        return None if isinstance(value, bool) else "true or false"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if tp is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    return None


def check_engine_args(path: str, items: tuple[str, ...] | list[str], given: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments for the factory at ``path``: ``--engine-arg``
    ``items`` (``KEY=VALUE``) parsed, over ``given`` (the command's own
    flags, which win), each checked against what the factory takes. The default
    factory takes ``EngineArgs`` fields, checked by name and by type (a text
    field keeps the text as written: ``model=123`` is the folder ``123``);
    another factory, by its signature. Raises :class:`EngineArgError`."""
    parsed = parse_engine_args(items)
    raw = {k.replace("-", "_"): v for k, _, v in (item.partition("=") for item in items)}
    factory = load_factory(path)
    if factory is build_engine:
        from jaxserve.engine.args import EngineArgs

        hints = typing.get_type_hints(EngineArgs)
        names = sorted(f.name for f in dataclasses.fields(EngineArgs))
        for key, value in parsed.items():
            if key not in hints:
                raise EngineArgError(f"--engine-arg {key}: not a setting of the engine; accepted: {', '.join(names)}")
            if hints[key] is str or typing.get_args(hints[key]) == (str, type(None)):
                parsed[key] = raw[key]  # text as written
                continue
            wants = _expected(hints[key], value)
            if wants is not None:
                raise EngineArgError(f"--engine-arg {key}={raw[key]!r}: expected {wants}")
    else:
        try:
            inspect.signature(factory).bind(**{**given, **parsed})
        except TypeError as exc:
            params = [p for p in inspect.signature(factory).parameters.values() if p.kind is not p.VAR_KEYWORD]
            accepted = ", ".join(p.name for p in params) or "none"
            raise EngineArgError(f"--engine-arg for {path}: {exc}; accepted: {accepted}") from None
    return {**parsed, **given}


def build_engine(model: str | None = None, **kwargs: Any) -> Any:
    """The real engine: ``Engine(EngineArgs.for_profile("serve", model=...,
    **kwargs))`` where the keywords are ``jaxserve.engine.args.EngineArgs``
    fields (``--engine-arg max_num_seqs=64 --engine-arg
    interactive_reserved_seqs=8``). What the ``serve`` profile sets, and
    why, is ``jaxserve.engine.args.PROFILES``: priority ordering, a quarter
    of the sequences reserved for interactive jobs, no async scheduling;
    any keyword given here wins."""
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.engine import Engine

    if model is not None:
        kwargs["model"] = model
    try:
        args = EngineArgs.for_profile("serve", **kwargs)
    except (TypeError, ValueError) as exc:  # a setting EngineArgs refuses: the user's, one line
        raise EngineArgError(f"engine settings: {exc}") from None
    return Engine.from_args(args)
