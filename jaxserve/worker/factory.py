"""Engine factories for ``jaxserve worker --engine MODULE:CALLABLE``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


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
    return Engine.from_args(EngineArgs.for_profile("serve", **kwargs))
