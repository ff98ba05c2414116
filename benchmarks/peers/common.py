"""What every offline peer shares: prompt loading, the result line, and the
``--serve`` loop the driver uses to interleave timed runs of several systems.

Imported by the peer scripts next to it (their folder is on ``sys.path`` when
they run as scripts), under either virtual environment: the standard library
only.

Protocol (``--serve``): the peer loads its model and warms up, prints
``@@bench {"event": "ready", ...}`` and then reads commands from stdin, one a
line: ``run K`` does K timed runs back to back and prints one
``@@bench {"event": "result", ...}`` line; ``quit`` (or end of input) exits.
Anything else the peer's libraries print on stdout is ignored by the driver.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

PREFIX = "@@bench "


def peer_arguments(description: str, *, warmup_tokens: bool = True) -> argparse.ArgumentParser:
    """The arguments every peer script takes (the driver passes the same ones
    to each); a peer adds its own system-specific options to the parser."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="checkpoint folder (jaxserve also takes a preset name)")
    parser.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    parser.add_argument("--output-len", type=int, default=128)
    if warmup_tokens:
        parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs (one-shot mode)")
    parser.add_argument("--serve", action="store_true", help="wait for 'run K' commands on stdin (see common.py)")
    return parser


def load_prompts(path: str) -> tuple[list[list[int]], int]:
    with open(path) as f:
        prompts = [[int(t) for t in p] for p in json.load(f)]
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        sys.exit("all prompts must have the same length")
    return prompts, lengths.pop()


def emit(record: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(record) + "\n")
    sys.stdout.flush()


def timed_runs(run: Callable[[], int], count: int, expected_tokens: int) -> dict:
    """Call ``run`` (returns the number of tokens generated) ``count`` times."""
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        generated = run()
        elapsed = time.perf_counter() - t0
        if generated != expected_tokens:
            raise RuntimeError(f"expected {expected_tokens} tokens, generated {generated}")
        times.append(elapsed)
    elapsed = statistics.median(times)
    return {
        "elapsed_s": round(elapsed, 4),
        "runs_s": [round(t, 4) for t in times],
        "output_tokens": expected_tokens,
        "output_tokens_per_s": round(expected_tokens / elapsed, 2),
        "runs_tok_s": [round(expected_tokens / t, 2) for t in times],
    }


def serve_or_once(base: dict, run: Callable[[], int], expected_tokens: int, serve: bool, repeats: int) -> None:
    """One-shot: ``repeats`` timed runs, one result line. Serve: the loop above."""
    if not serve:
        emit({"event": "result", **base, **timed_runs(run, repeats, expected_tokens)})
        return
    serve_commands(base, lambda args: timed_runs(run, int(args[0]) if args else 1, expected_tokens))


def serve_commands(base: dict, on_run: Callable[[list[str]], dict]) -> None:
    """The ``--serve`` loop: ``ready``, then for each ``run ARGS...`` line on
    stdin one ``result`` (``base`` and what ``on_run(ARGS)`` returns) or one
    ``error``; ends at ``quit`` or end of input."""
    emit({"event": "ready", **base})
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] == "run":
            try:
                emit({"event": "result", **base, **on_run(words[1:])})
            except Exception as exc:  # noqa: BLE001 - reported to the driver, which decides
                emit({"event": "error", **base, "error": repr(exc)})
