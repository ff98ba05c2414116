"""``jaxserve bench``: throughput measurements of the engine."""

from __future__ import annotations

import time

import click
import numpy as np
import orjson

from jaxserve.cli.errors import user_errors
from jaxserve.cli.options import engine_option, kv_cache_dtype_option, quantization_option, speculative_options


@click.group()
def bench() -> None:
    """Measure the engine."""


@bench.command("offline")
@engine_option("--model", field="model", profile="offline", help="Preset name or checkpoint folder.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=None, help="Default: the number of prompts (at most 256)."
)
@engine_option(
    "--max-num-batched-tokens",
    field="max_num_batched_tokens",
    profile="offline",
    forward_unset=True,
    type=click.IntRange(min=1),
)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True)
@quantization_option
@kv_cache_dtype_option("offline")
@speculative_options("offline")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@engine_option(
    "--tensor-parallel-size",
    field="tensor_parallel_size",
    profile="offline",
    type=click.IntRange(min=1),
    help="Devices to shard the model over (must divide its kv heads).",
)
def offline(
    model,
    num_prompts,
    input_len,
    output_len,
    max_num_seqs,
    max_num_batched_tokens,
    dtype,
    quantization,
    kv_cache_dtype,
    num_speculative_tokens,
    speculative_method,
    seed,
    as_json,
    tensor_parallel_size,
) -> None:
    """Run NUM_PROMPTS prompts of INPUT_LEN random token ids to exactly
    OUTPUT_LEN new tokens each (EOS ignored, greedy), after a warm-up, and
    report output tokens per second."""
    from jaxserve.engine.llm import LLM
    from jaxserve.worker.logs import configure_logging

    configure_logging(level="warning")
    from jaxserve.sampling_params import SamplingParams

    max_num_seqs = max_num_seqs or min(num_prompts, 256)
    with user_errors():
        llm = LLM(
            model,
            dtype=None if dtype == "auto" else dtype,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            num_speculative_tokens=num_speculative_tokens,
            speculative_method=speculative_method,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max(input_len + output_len, 64),
            enable_prefix_caching=False,
            tensor_parallel_size=tensor_parallel_size,
        )
    vocab = llm.engine.tokenizer.vocab_size
    special = set(llm.engine.special_token_ids)
    rng = np.random.default_rng(seed)
    pool = np.array([i for i in range(min(vocab, llm.engine.model_config.vocab_size)) if i not in special])
    prompts = [rng.choice(pool, size=input_len).tolist() for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Warm-up: one short request through every code path (compilation already
    # happened when the engine started).
    llm.generate([prompts[0][: min(16, input_len)]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    generated = sum(o.completion_tokens for o in outputs)
    if generated != num_prompts * output_len:
        raise click.ClickException(f"expected {num_prompts * output_len} tokens, generated {generated}")
    result = {
        "model": model,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "elapsed_s": round(elapsed, 4),
        "output_tokens": generated,
        "output_tokens_per_s": round(generated / elapsed, 2),
        "total_tokens_per_s": round((generated + num_prompts * input_len) / elapsed, 2),
        "compile_s": round(llm.engine.compile_seconds, 2),
        "num_blocks": llm.engine.num_blocks,
        "kv_cache_dtype": llm.engine.kv_cache_size.dtype,
        "kv_cache_bytes": llm.engine.runner.kv_cache.nbytes,
        "tensor_parallel_size": tensor_parallel_size,
        "attention": llm.engine.attention.kernel,
        "quantization": quantization,
        "num_speculative_tokens": num_speculative_tokens,
    }
    if as_json:
        click.echo(orjson.dumps(result).decode())
    else:
        click.echo(
            f"{num_prompts} prompts x {input_len} in -> {output_len} out: "
            f"{result['output_tokens_per_s']:.1f} output tok/s ({elapsed:.2f} s)"
        )
