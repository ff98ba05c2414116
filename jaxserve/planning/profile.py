"""A model's measured speed on one machine: the planner's input.

``jaxserve plan --measure --model M --output PROFILE.json`` builds the real
engine (``jaxserve.engine.LLM``) the way a worker with ``--max-num-seqs`` =
the largest batch size builds it (the model's default ``max_model_len``,
the KV cache that holds that many requests of it, prefix caching off) and
measures:

- **prefill**: for each chunk size C, one request of C random token ids
  and ``max_tokens`` 1 at a time, timed from ``add_request`` to its
  finished output (that step computes exactly C tokens and samples one);
  the median of ``repeats`` runs gives ``tokens_per_s = C / seconds``;
- **decode**: for each context length L and batch size B, B requests of L
  random prompt tokens; once every one has its first token, ``decode_steps``
  engine steps (every sequence decoding) are timed:
  ``tokens_per_s = tokens produced / seconds``, the median of ``repeats``;
  then the requests are aborted;
- **KV bytes per token**: the engine's KV cache bytes divided by the tokens
  it holds (``num_blocks x block_size``), all layers, keys and values.

Sampling: ``temperature`` (default 1.0, what a job without one gets;
temperature 0 takes the greedy path, which is much faster on the CPU
backend: measure the way the workload samples). The context matters too: a
decode step's attention grows with its longest sequence, so the planner
reads the decode rate at the workload's p95 sequence length.

The profile also records the block size, dtype, weight bytes, device memory,
the engine settings and the machine, so a plan can say what it assumed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.json_files import read_json

PROFILE_KIND = "jaxserve-profile"
PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used."""


def _normalize_decode(decode: Mapping) -> dict[int, dict[int, float]]:
    """``{context: {batch: rate}}``; a flat ``{batch: rate}`` is one
    measurement at an unknown context (0)."""
    if decode and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in decode.values()):
        return {0: dict(decode)}
    return {int(c): dict(t) for c, t in decode.items()}


@dataclasses.dataclass(frozen=True)
class Profile:
    """Prefill rates by chunk size, decode rates by context and batch size, KV sizing."""

    model: str
    prefill: dict[int, float]  # chunk tokens -> prefill tokens/s
    decode: dict[int, dict[int, float]]  # context tokens -> batch size -> decode tokens/s (all sequences)
    kv_bytes_per_token: int
    block_size: int
    weight_bytes: int = 0
    device_memory_bytes: int | None = None
    max_model_len: int | None = None  # the model's default (min(max_position_embeddings, 4096))
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode", _normalize_decode(self.decode))
        if not self.prefill or not self.decode or not all(self.decode.values()):
            raise ProfileError("a profile needs at least one prefill and one decode measurement")
        tables = [("prefill chunk", self.prefill)] + [
            (f"decode batch (context {c})", t) for c, t in self.decode.items()
        ]
        for what, table in tables:
            for size, rate in table.items():
                if not (isinstance(size, int) and size >= 1 and isinstance(rate, (int, float)) and rate > 0):
                    raise ProfileError(f"{what} {size!r}: a size >= 1 with a rate > 0 tokens/s is needed, got {rate!r}")
        if not (isinstance(self.kv_bytes_per_token, int) and self.kv_bytes_per_token > 0):
            raise ProfileError(f"kv_bytes_per_token must be a positive integer, got {self.kv_bytes_per_token!r}")
        if not (isinstance(self.block_size, int) and self.block_size > 0):
            raise ProfileError(f"block_size must be a positive integer, got {self.block_size!r}")

    # ----------------------------------------------------------- rates
    def prefill_rate(self, chunk: int) -> float:
        """Prefill tokens/s at ``chunk``-token steps (linear between the
        measured chunk sizes, the nearest measured one outside them)."""
        xs = sorted(self.prefill)
        return float(np.interp(chunk, xs, [self.prefill[x] for x in xs]))

    @property
    def contexts(self) -> list[int]:
        return sorted(self.decode)

    @property
    def batches(self) -> list[int]:
        return sorted({b for t in self.decode.values() for b in t})

    def decode_rate(self, batch: int, context: float | None = None) -> float:
        """Decode tokens/s of ``batch`` sequences of ``context`` tokens:
        linear between the measured batch sizes (flat outside them) at each
        measured context, then linear between the contexts (flat outside;
        no context given: the longest measured one)."""
        ctxs = self.contexts
        at = []
        for c in ctxs:
            xs = sorted(self.decode[c])
            at.append(float(np.interp(batch, xs, [self.decode[c][x] for x in xs])))
        if context is None:
            return at[-1]
        return float(np.interp(context, ctxs, at))

    def itl(self, batch: int, context: float | None = None) -> float:
        """Seconds between two tokens of one sequence in a decode step of ``batch``."""
        return batch / self.decode_rate(batch, context)

    @property
    def best_chunk(self) -> int:
        """The measured chunk size with the highest prefill rate (the smallest of equals)."""
        return max(sorted(self.prefill), key=lambda c: self.prefill[c])

    def saturation_batch(self, context: float | None = None) -> int:
        """The measured batch size with the highest decode rate at ``context``
        (the smallest of equals): a bigger batch makes no more tokens per second."""
        return max(self.batches, key=lambda b: self.decode_rate(b, context))

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    # ------------------------------------------------------------- I/O
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PROFILE_KIND,
            "version": PROFILE_VERSION,
            "model": self.model,
            "prefill": [{"chunk_tokens": c, "tokens_per_s": round(self.prefill[c], 3)} for c in sorted(self.prefill)],
            "decode": [
                {"context_tokens": c, "batch": b, "tokens_per_s": round(self.decode[c][b], 3)}
                for c in self.contexts
                for b in sorted(self.decode[c])
            ],
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size,
            "weight_bytes": self.weight_bytes,
            "device_memory_bytes": self.device_memory_bytes,
            "max_model_len": self.max_model_len,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise ProfileError(
                f"not a jaxserve profile (expected kind {PROFILE_KIND!r}; write one with jaxserve plan --measure)"
            )
        try:
            decode: dict[int, dict[int, float]] = {}
            for x in data["decode"]:
                decode.setdefault(int(x.get("context_tokens") or 0), {})[int(x["batch"])] = float(x["tokens_per_s"])
            return cls(
                model=str(data["model"]),
                prefill={int(x["chunk_tokens"]): float(x["tokens_per_s"]) for x in data["prefill"]},
                decode=decode,
                kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                block_size=int(data["block_size"]),
                weight_bytes=int(data.get("weight_bytes") or 0),
                device_memory_bytes=None
                if data.get("device_memory_bytes") is None
                else int(data["device_memory_bytes"]),
                max_model_len=None if data.get("max_model_len") is None else int(data["max_model_len"]),
                meta=dict(data.get("meta") or {}),
            )
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"malformed profile: {exc!r}") from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(read_json(path, ProfileError, "the profile "))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


# ----------------------------------------------------------------- measure
def _median_s(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def measure(
    model: str,
    *,
    chunks: Sequence[int] = (64, 128, 256, 512),
    batches: Sequence[int] = (1, 4, 16, 32),
    contexts: Sequence[int] = (128, 1024),
    decode_steps: int = 16,
    repeats: int = 3,
    temperature: float = 1.0,
    dtype: str | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Measure ``model`` with the real engine (see the module docstring)."""
    from jaxserve.engine.args import device_memory_bytes
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    say = progress or (lambda _msg: None)
    chunks, batches, contexts = sorted(set(chunks)), sorted(set(batches)), sorted(set(contexts))
    if not chunks or not batches or not contexts or min(chunks + batches + contexts) < 1:
        raise ValueError("give chunk sizes, batch sizes and contexts >= 1")
    if repeats < 1 or decode_steps < 1:
        raise ValueError("repeats and decode steps must be >= 1")
    budget = max(max(chunks), max(batches))
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        max_num_seqs=max(batches),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )
    if block_size is not None:
        kwargs["block_size"] = block_size
    t_build = time.perf_counter()
    say(f"building and compiling the engine for {model} (max_num_seqs {max(batches)}, step budget {budget})")
    llm = LLM(model, **kwargs)
    engine = llm.engine
    build_s = time.perf_counter() - t_build
    mml = engine.max_model_len
    # a decode request: its context, the steps its batch's prefill takes, the timed steps
    too_long = [c for c in contexts if c + decode_steps + math.ceil(max(batches) * c / budget) + 4 > mml]
    if too_long or max(chunks) + 1 > mml:
        raise ValueError(
            f"contexts {too_long or ''} / chunk {max(chunks)} do not fit max_model_len {mml} with the decode steps"
        )
    vocab = min(engine.tokenizer.vocab_size, engine.model_config.vocab_size)
    special = set(engine.special_token_ids)
    pool = np.array([i for i in range(vocab) if i not in special])
    rng = np.random.default_rng(seed)
    ids = iter(range(1 << 30))

    def drain() -> None:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.error is not None:
                    raise RuntimeError(f"measurement request failed: {out.error.code}: {out.error.message}")

    one = SamplingParams(max_tokens=1, temperature=temperature, ignore_eos=True)
    engine.add_request(f"warm-{next(ids)}", rng.choice(pool, size=min(16, max(chunks))).tolist(), one)
    drain()

    prefill: dict[int, float] = {}
    prefill_s: dict[int, float] = {}
    for c in chunks:

        def once(c: int = c) -> float:
            prompt = rng.choice(pool, size=c).tolist()
            t0 = time.perf_counter()
            engine.add_request(f"prefill-{next(ids)}", prompt, one)
            drain()
            return time.perf_counter() - t0

        once()  # untimed: the first run of this shape
        secs = _median_s(once, repeats)
        prefill[c], prefill_s[c] = c / secs, secs
        say(f"prefill {c:5d} tokens: {secs * 1e3:8.2f} ms  {prefill[c]:10.1f} tok/s")

    decode: dict[int, dict[int, float]] = {}
    decode_s: dict[str, float] = {}
    for ctx in contexts:
        for b in batches:
            params = SamplingParams(
                max_tokens=decode_steps + math.ceil(b * ctx / budget) + 4, temperature=temperature, ignore_eos=True
            )

            def once_decode(b: int = b, ctx: int = ctx, params: SamplingParams = params) -> float:
                rids = [f"decode-{next(ids)}" for _ in range(b)]
                for rid in rids:
                    engine.add_request(rid, rng.choice(pool, size=ctx).tolist(), params)
                started: set[str] = set()
                while len(started) < b:
                    for out in engine.step():
                        if out.new_token_ids:
                            started.add(out.request_id)
                        if out.finished:
                            raise RuntimeError(f"decode batch {b}: a request finished before the timed steps")
                tokens = 0
                t0 = time.perf_counter()
                for _ in range(decode_steps):
                    tokens += sum(len(out.new_token_ids) for out in engine.step())
                elapsed = time.perf_counter() - t0
                for rid in rids:
                    engine.abort(rid)
                drain()
                return elapsed / max(tokens, 1)

            once_decode()  # untimed: the first run of this shape
            per_token = _median_s(once_decode, repeats)
            decode.setdefault(ctx, {})[b] = 1.0 / per_token
            decode_s[f"{ctx}x{b}"] = round(per_token * b, 6)
            say(
                f"decode  context {ctx:5d} batch {b:4d}: step {per_token * b * 1e3:8.2f} ms  {1 / per_token:10.1f} tok/s"
            )

    cache = engine.runner.kv_cache
    tokens_held = engine.num_blocks * engine.args.block_size
    kv_bytes_per_token = int(cache.nbytes // tokens_held)
    import jax

    leaves = [x for x in jax.tree.leaves(engine.runner.state) if hasattr(x, "dtype")]
    weight_bytes = int(sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves))
    cfg = engine.model_config
    meta = {
        "created_unix": round(time.time(), 3),
        "machine": _machine(),
        "engine": {
            "dtype": str(cache.dtype),
            "num_layers": cfg.num_hidden_layers,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "attention": getattr(engine.attention, "kernel", None),
            "max_num_seqs": max(batches),
            "max_num_batched_tokens": budget,
            "max_model_len": mml,
            "num_blocks": engine.num_blocks,
            "build_and_compile_s": round(build_s, 2),
        },
        "method": {
            "chunks": chunks,
            "batches": batches,
            "contexts": contexts,
            "decode_steps": decode_steps,
            "repeats": repeats,
            "temperature": temperature,
            "seed": seed,
            "prefill_step_s": {str(c): round(s, 6) for c, s in prefill_s.items()},
            "decode_step_s": decode_s,
        },
    }
    return Profile(
        model=model,
        prefill=prefill,
        decode=decode,
        kv_bytes_per_token=kv_bytes_per_token,
        block_size=int(engine.args.block_size),
        weight_bytes=weight_bytes,
        device_memory_bytes=int(device_memory_bytes()),
        max_model_len=min(int(cfg.max_position_embeddings), 4096),
        meta=meta,
    )


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import jax

        info["jax"] = jax.__version__
        info["backend"] = jax.default_backend()
        info["device_kind"] = jax.devices()[0].device_kind
        info["devices"] = jax.device_count()
    except Exception:  # noqa: BLE001 - informative only
        pass
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info
