"""Everything needed to build an :class:`~jaxserve.engine.engine.Engine`.

``EngineArgs`` is what users and the CLI set; the engine derives the
scheduler's configuration (:meth:`EngineArgs.scheduler_config`) and the KV
cache size from it. Every engine setting's default is written once, as an
``EngineArgs`` field default; a use that wants other values names a profile
(:data:`PROFILES`: ``offline`` for ``LLM`` and ``jaxserve generate``,
``serve`` for the queue worker), and ``SchedulerConfig`` and the CLI read
their defaults from here (``tests/test_settings_sources.py``).

This module imports no JAX at import time: ``jaxserve worker``'s process
reads the serving profile for its options' help and never imports JAX.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from jaxserve.engine.config import SchedulerConfig
    from jaxserve.engine.speculative import SpeculativeConfig

#: the profiles :data:`PROFILES` names
ProfileName = Literal["engine", "offline", "serve"]


@dataclasses.dataclass
class EngineArgs:
    """Engine settings. ``None`` means "derive a sensible value".

    - ``model``: checkpoint folder or preset name (``tiny``).
    - ``dtype``: ``float32``/``bfloat16``; ``None`` keeps the checkpoint's.
    - ``quantization``: ``"int8"`` or ``"int4"`` stores every linear weight,
      the embedding and the vocabulary projection in blocks of 32 with a
      float16 scale (int4: and a min), quantized tensor by tensor at load
      (``jaxserve.models.quant``); a GGUF file's Q8_0/Q4_0/Q4_1 tensors are
      taken as they are. ``None``: float weights. One device only.
    - ``max_model_len``: prompt + output tokens per request; default the
      model's ``max_position_embeddings`` capped at 4096.
    - ``kv_cache_memory``: bytes for the KV cache, or
      ``memory_fraction`` of device memory (host RAM on CPU) after the
      weights: the ``gpu_memory_utilization`` of other servers. Neither:
      sized to need, ``max_num_seqs`` sequences of ``max_model_len`` tokens
      each up to :data:`DEFAULT_KV_TOKENS_PER_SEQ` (1024), and at least one
      sequence of ``max_model_len``, within a quarter of device memory
      (:meth:`size_kv_cache` says why; the engine logs it at start).
    - ``kv_cache_dtype``: the KV cache's element type (vLLM's
      ``--kv-cache-dtype``): ``auto`` (the model's dtype), ``float32``,
      ``bfloat16``, or ``int8`` (each token's key and value vectors per kv
      head stored as int8 with a float32 scale, ``jaxserve.kernels.kv_cache``:
      ``head_dim + 4`` bytes instead of ``4 * head_dim``, 0.27x a float32
      cache at head_dim 64 and 0.53x a bfloat16 one).
    - ``compilation_cache_dir``: JAX's persistent compilation cache, so a
      restarted worker skips compiling (``""`` disables it).
    - ``cache_forward_programs``: whether the forward programs (one per
      token bucket) come from that cache too. False compiles them at every
      start and keeps the cache for the small programs: on XLA:CPU a
      forward program loaded from the cache holds more than a freshly
      compiled one (SmolLM2-135M's int8 worker with an int8 KV cache:
      1,028 MiB in all against 1,012), at about 0.5 s of compiling each on
      2 cores (the memory scenario in BENCHMARKS.md).
    - ``async_scheduling``: plan and launch step N+1 before waiting for
      step N when N's tokens stay on the device (all-greedy decode steps),
      so the host's planning overlaps the device's work (vLLM's async
      scheduling). A request ending on a stop id then computes one extra,
      discarded token. On by default here (offline throughput); the
      ``serve`` profile turns it off (see :data:`PROFILES`), since a step
      launched ahead cannot take a job that arrives meanwhile.
    - ``block_size``: tokens per KV block, also the prefix cache's unit of
      sharing. 64 by default: paged attention reads a sequence's context one
      block per loop iteration, and bigger blocks mean fewer, larger gathers
      (64 x 193-token decode on a 2-core host: 12.3 ms with 64-token blocks,
      14.9 ms with 32, 20.3 ms with 16). vLLM's CPU backend uses 128.
    - ``attention_backend``: ``"auto"`` (default), ``"reference"``,
      ``"pallas"`` or ``"cpu"`` (``jaxserve.kernels.backends``). ``auto``
      runs the C++ paged-attention kernel on the CPU (built on first use;
      float32 caches; the pure-JAX kernels where it cannot build), and the
      paged-attention kernels JAX ships in Pallas on GPU and TPU when the
      model's shapes fit them (decode-sized programs; prefill-sized ones on
      the reference, or the ragged kernel on TPU); ``pallas`` and ``cpu``
      insist (an error where they cannot run), ``reference`` always runs
      the pure-JAX kernels.
    - ``interactive_prefill_alone``: a step that starts an interactive
      prompt carries no batch work (``SchedulerConfig``), so the time to an
      interactive request's first token does not grow with the batch load.
    - ``interactive_batch_prefill_tokens`` / ``interactive_recent_s``:
      while interactive work is about (waiting, running, or seen within
      ``interactive_recent_s`` seconds), the batch prompt tokens one step may
      carry (``SchedulerConfig``; 0: no cap). An interactive prompt that
      arrives waits for the step in flight, and batch prompt chunks are what
      make a step long; the cap keeps that wait near a decode step's length.
      Batch-only serving is untouched. The default 32 is measured
      (commit 39f6eec's A/B runs, llama-56m under a saturated batch
      queue): it leaves the median TTFT where it was but trims the tail
      (loaded p90 36-67 ms against 40-130 ms uncapped, on two machines) for
      0-4% of the batch jobs done while interactive jobs run; 16 cost about
      a tenth of the batch work.
    - ``interactive_step_tokens``: at the same times, the tokens of a step
      that carries batch work, decodes included, interactive ones never cut
      (``SchedulerConfig``; 0: no cap). The prompt cap alone leaves a step
      of every running batch decode, and on a deep model that step is as
      long as an interactive prompt's own or longer (SmolLM2-135M, 30
      layers: 24 batch decodes and 32 prompt tokens, the 64-token bucket),
      so the rest of it was most of a loaded first token's extra wait; the
      batch decodes beyond the cap take turns. The runner pads a step to
      its token bucket, and the cost follows the bucket, not the rows
      (``benchmarks/step_bucket_probe.py``, SmolLM2-135M f32, 2 busy cores,
      two runs, medians: bucket 64 232/208 ms, 32 156/174, 16 151/142, 8
      113/83), so the default 32 removes the 64-token steps and keeps every
      batch decode in each step; 16 would save at most a fifth of the step
      for a third of the batch rows.
    - ``tensor_parallel_size``: devices one engine shards the model and the
      KV cache over (attention heads, kv heads and the MLP, Megatron style;
      ``jaxserve.models.sharding``); it must divide the model's kv heads.
      ``kv_cache_memory`` and the derived cache size are totals over those
      devices.
    - ``num_speculative_tokens`` / ``speculative_method`` /
      ``prompt_lookup_max`` / ``prompt_lookup_min`` (vLLM's names):
      speculative decoding (``jaxserve.engine.speculative``). A decoding
      sequence may carry up to ``num_speculative_tokens`` guessed tokens
      into a step, verified there by the model: the output is the one
      decoding without them gives (greedy token for token, sampled from
      the same distribution, a seeded job the same text). ``ngram``, the
      one method: the sequence's last ``prompt_lookup_max`` down to
      ``prompt_lookup_min`` tokens matched earlier in its prompt and
      output, the tokens after the match guessed, and under a grammar the
      tokens it forces. A step carries guesses only where their expected
      yield pays for the bigger step; rows without a match decode as
      usual. On by default (4); 0 turns it off, and a job turns it off or
      lowers it with ``SamplingParams.num_speculative_tokens``. The step's
      logits rows (``SchedulerConfig.max_num_logits_rows``) grow with it,
      so the sampling programs are compiled for more rows.
    """

    model: str = "tiny"
    dtype: Literal["float32", "bfloat16"] | None = None
    quantization: Literal["int8", "int4"] | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 64
    kv_cache_memory: int | None = None
    memory_fraction: float | None = None
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8"] = "auto"
    policy: Literal["fcfs", "priority"] = "fcfs"
    interactive_reserved_seqs: int = 0
    interactive_reserved_blocks: int = 0
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    max_num_waiting: int = 0
    interactive_prefill_alone: bool = True
    interactive_batch_prefill_tokens: int = 32
    interactive_recent_s: float = 2.0
    interactive_step_tokens: int = 32
    seed: int = 0
    compilation_cache_dir: str | None = None
    cache_forward_programs: bool = True
    async_scheduling: bool = True
    served_model_name: str | None = None
    attention_backend: Literal["auto", "reference", "pallas", "cpu"] = "auto"
    tensor_parallel_size: int = 1
    num_speculative_tokens: int = 4
    speculative_method: Literal["ngram"] = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        from jaxserve.kernels.backends import BACKENDS

        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        self.speculative_config().validate()
        from jaxserve.models.quant import check_quantization

        check_quantization(self.quantization)
        if self.quantization is not None and size > 1:
            raise ValueError(
                f"quantization={self.quantization!r} serves one device; tensor_parallel_size={size} is not supported with it"
            )

    @classmethod
    def for_profile(cls, profile: ProfileName, **overrides: Any) -> EngineArgs:
        """``EngineArgs`` of a named profile (:data:`PROFILES`), ``overrides``
        on top: ``EngineArgs.for_profile("serve", model="tiny", max_num_seqs=64)``
        reserves 16 sequences for interactive jobs."""
        values = profile_values(profile, max_num_seqs=overrides.get("max_num_seqs"))
        values.update(overrides)
        return cls(**values)

    def speculative_config(self) -> SpeculativeConfig:
        """The drafter's settings (``jaxserve.engine.speculative``)."""
        from jaxserve.engine.speculative import SpeculativeConfig

        return SpeculativeConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            method=self.speculative_method,
            prompt_lookup_max=self.prompt_lookup_max,
            prompt_lookup_min=self.prompt_lookup_min,
        )

    def scheduler_config(self, *, max_model_len: int, num_blocks: int) -> SchedulerConfig:
        """The scheduler's configuration: every ``SchedulerConfig`` field
        ``EngineArgs`` has, as set here, and the sizes the engine resolved
        (``max_model_len`` from the model, ``num_blocks`` from the memory
        budget). The one place the engine's settings reach the scheduler."""
        from jaxserve.engine.config import SchedulerConfig

        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig) if f.name in _FIELDS}
        shared["max_num_batched_tokens"] = self.resolve_max_num_batched_tokens()
        return SchedulerConfig(**{**shared, "max_model_len": max_model_len, "num_blocks": num_blocks})

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        limit = self.max_model_len or min(max_position_embeddings, 4096)
        if limit > max_position_embeddings:
            raise ValueError(
                f"max_model_len={limit} exceeds the model's max_position_embeddings={max_position_embeddings}"
            )
        return limit

    def resolve_max_num_batched_tokens(self) -> int:
        value = self.max_num_batched_tokens or max(512, self.max_num_seqs)
        return max(value, self.max_num_seqs)

    def resolve_kv_cache_dtype(self, model_dtype: Any) -> str:
        """The KV cache's element type name for a model of ``model_dtype``
        (``kv_cache_dtype``; ``auto``: the model's)."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        import numpy as np

        return np.dtype(model_dtype).name

    def resolve_num_blocks(self, **sizes: Any) -> int:
        """The KV cache's blocks, null block included: the ``num_blocks`` of
        :meth:`size_kv_cache` for the same keyword arguments (one sizing
        rule, so the count always matches the size it reports)."""
        return self.size_kv_cache(**sizes).num_blocks

    def size_kv_cache(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        cache_dtype,
        max_model_len: int,
        weight_bytes: int,
    ) -> KVCacheSize:
        """The KV cache's size and why (the class docstring's rules):
        ``kv_cache_memory`` bytes as given; else ``memory_fraction`` of
        device memory less the weights; else sized to need. Raises
        ``ValueError`` when one request of ``max_model_len`` cannot fit."""
        from jaxserve.kernels.kv_cache import bytes_per_block

        per_block = bytes_per_block(num_layers, self.block_size, num_kv_heads, head_dim, cache_dtype)
        blocks_per_seq = -(-max_model_len // self.block_size)
        seq_tokens = max_model_len
        if self.kv_cache_memory is not None:
            budget = int(self.kv_cache_memory)
            reason = f"kv_cache_memory={budget}"
        elif self.memory_fraction is not None:
            if not 0.0 < self.memory_fraction <= 1.0:
                raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
            memory = device_memory_bytes()
            budget = int(memory * self.memory_fraction) - weight_bytes
            reason = f"memory_fraction={self.memory_fraction:g} of {memory} bytes, less {weight_bytes} of weights"
        else:
            seq_tokens = min(max_model_len, DEFAULT_KV_TOKENS_PER_SEQ)
            need = max(self.max_num_seqs * -(-seq_tokens // self.block_size), blocks_per_seq) + 1
            wanted = need * per_block
            quarter = device_memory_bytes() // 4
            budget = min(wanted, quarter)
            reason = f"default: max_num_seqs={self.max_num_seqs} sequences of {seq_tokens} tokens"
            if seq_tokens < max_model_len:
                reason += f" (max_model_len={max_model_len} capped at {DEFAULT_KV_TOKENS_PER_SEQ}), at least one of {max_model_len}"
            if quarter < wanted:
                reason += f", capped at a quarter of device memory ({quarter} bytes)"
        num_blocks = budget // per_block
        if num_blocks < blocks_per_seq + 1:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; one "
                f"request of max_model_len={max_model_len} needs {blocks_per_seq} blocks plus the null block. "
                f"Raise kv_cache_memory/memory_fraction or lower max_model_len"
            )
        return KVCacheSize(
            num_blocks=int(num_blocks),
            block_size=self.block_size,
            block_bytes=per_block,
            dtype=str(cache_dtype if isinstance(cache_dtype, str) else getattr(cache_dtype, "name", cache_dtype)),
            seqs=self.max_num_seqs,
            seq_tokens=seq_tokens,
            max_model_len=max_model_len,
            reason=reason,
        )


#: the KV cache dtypes ``EngineArgs.kv_cache_dtype`` takes (``auto``: the model's dtype)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")

#: Tokens per sequence the default KV cache holds when ``max_model_len`` is
#: longer: a model's whole context is what a request may use, not what the
#: average one does. 1024 is llama-server's default per slot (its default
#: 4096-token context over 4 parallel slots), and a queue job's prompt and
#: output usually fit in it; a longer request still runs (the cache keeps
#: room for one of ``max_model_len``), and when many long ones run together
#: the scheduler preempts, as it does whenever blocks run out. Before it, a
#: ``jaxserve worker`` serving SmolLM2-135M (context 8192, taken as 4096)
#: with 32 sequences reserved 32 x 4096 tokens x 45 KiB = 6.0 GB of float32
#: cache (within a quarter of this 25 GB machine); with it 1.5 GB, or
#: 0.4 GB as int8.
DEFAULT_KV_TOKENS_PER_SEQ = 1024


@dataclasses.dataclass(frozen=True)
class KVCacheSize:
    """The KV cache :meth:`EngineArgs.size_kv_cache` resolved, and why."""

    num_blocks: int  # the null block included
    block_size: int
    block_bytes: int  # over all layers, keys and values (int8: their scales too)
    dtype: str
    seqs: int  # the sequences the default sizes for (max_num_seqs)
    seq_tokens: int  # ... and the tokens of each
    max_model_len: int
    reason: str

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def tokens(self) -> int:
        """Tokens the usable blocks hold (the null block left out)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def describe(self) -> str:
        """One line for the start log: how much, for what, and why."""
        full = (self.num_blocks - 1) // -(-self.max_model_len // self.block_size)
        return (
            f"{self.bytes / 2**20:.1f} MiB of {self.dtype} KV cache: {self.tokens} tokens "
            f"({self.bytes_per_token} bytes each), {full} sequence(s) of max_model_len={self.max_model_len} "
            f"at once; {self.reason}"
        )


def device_memory_bytes() -> int:
    """Memory of the first device: HBM on accelerators, physical RAM on CPU."""
    import jax

    device = jax.devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def engine_default(name: str) -> Any:
    """``EngineArgs``' default for the field ``name`` (``SchedulerConfig``
    reads its defaults through this, so each is written once)."""
    return _FIELDS[name].default


def serving_reserved_seqs(max_num_seqs: int) -> int:
    """The ``serve`` profile's ``interactive_reserved_seqs``: a quarter of
    the sequence slots (at least one, none when there is only one), so an
    interactive job finds a slot however deep the batch queue is."""
    return max(1, max_num_seqs // 4) if max_num_seqs > 1 else 0


#: What each use changes from the ``EngineArgs`` field defaults (``engine``:
#: nothing).
#:
#: - ``offline`` (``LLM``, ``jaxserve generate``): a 2048-token step budget.
#:   Offline runs want throughput, not inter-token latency: a bigger budget
#:   finishes the prefill of a large batch in a few steps, so every sequence
#:   then decodes in one full batch instead of trickling in (llama-56m, 64 x
#:   128 prompts: prefill 3.36 s at 512 vs 3.14 s at 2048; decode steps
#:   unchanged), as vLLM picks a larger budget for its offline ``LLM`` class
#:   than for its server.
#: - ``serve`` (``jaxserve worker``'s ``jaxserve.worker.factory.build_engine``):
#:   ``priority`` ordering, a quarter of the sequences reserved for
#:   interactive jobs (:func:`serving_reserved_seqs`, derived from
#:   ``max_num_seqs``), and no async scheduling: a step launched ahead of the
#:   wait was planned before a job that arrives during that wait, so an
#:   interactive prompt would start one whole step later (llama-56m behind a
#:   deep batch queue: time to first token 2.11x idle with it, 1.35x without,
#:   BENCHMARKS.md) for a throughput gain within a 2-core CPU's noise. A
#:   worker serving batch jobs only can turn it back on
#:   (``--engine-arg async_scheduling=true``).
PROFILES: dict[str, dict[str, Any]] = {
    "engine": {},
    "offline": {"max_num_batched_tokens": 2048},
    "serve": {"policy": "priority", "async_scheduling": False},
}


def profile_values(profile: ProfileName, *, max_num_seqs: int | None = None) -> dict[str, Any]:
    """Every ``EngineArgs`` field's value under ``profile``, without building
    an ``EngineArgs`` (no JAX): the field defaults, the profile's changes,
    and what the profile derives from ``max_num_seqs`` (the given one, else
    the default)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    values: dict[str, Any] = {name: f.default for name, f in _FIELDS.items()}
    values.update(PROFILES[profile])
    if profile == "serve":
        seqs = values["max_num_seqs"] if max_num_seqs is None else max_num_seqs
        values["interactive_reserved_seqs"] = serving_reserved_seqs(seqs)
    return values
