"""``jaxserve generate``: one prompt through the engine, offline."""

from __future__ import annotations

import sys

import click
import orjson

from jaxserve.cli.errors import user_errors
from jaxserve.cli.options import engine_option, kv_cache_dtype_option, quantization_option, speculative_options


@click.command()
@engine_option("--model", field="model", profile="offline", help="Preset name or checkpoint folder.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables top-k.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (reproducible output).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True)
@quantization_option
@kv_cache_dtype_option("offline")
@speculative_options("offline")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message and render the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text and token_ids.")
@engine_option(
    "--tensor-parallel-size",
    field="tensor_parallel_size",
    profile="offline",
    type=click.IntRange(min=1),
    help="Devices to shard the model over (must divide its kv heads).",
)
@click.argument("prompt")
def generate(
    model,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    stop,
    dtype,
    quantization,
    kv_cache_dtype,
    num_speculative_tokens,
    speculative_method,
    chat,
    as_json,
    tensor_parallel_size,
    prompt,
) -> None:
    """Generate a completion for PROMPT and print it."""
    from jaxserve.engine.llm import LLM
    from jaxserve.worker.logs import configure_logging

    configure_logging(level="warning")
    from jaxserve.sampling_params import SamplingParams

    with user_errors():
        llm = LLM(
            model,
            dtype=None if dtype == "auto" else dtype,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            num_speculative_tokens=num_speculative_tokens,
            speculative_method=speculative_method,
            max_num_seqs=1,
            tensor_parallel_size=tensor_parallel_size,
        )
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=tuple(stop)
    )
    request: str | list[int] = prompt
    if chat:
        if getattr(llm.engine.tokenizer, "chat_templates", None) == {}:
            # named as the user gave it (a .gguf file, not the folder derived from it), with the fix
            # the command offers (tests/test_cli_errors.py)
            raise click.ClickException(
                f"--chat: {model} has no chat template (none in its tokenizer_config.json or GGUF metadata, no "
                "chat_template.jinja beside it); drop --chat to send PROMPT as plain text"
            )
        with user_errors():  # a template that fails to render: one line, not a traceback
            # token ids, as the worker sends them: the template writes its own BOS, and the
            # rendered text encoded again would start with a second one (Gemma's, Llama 3's)
            request = llm.engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    (out,) = llm.generate([request], params)
    if out.error is not None:
        raise click.ClickException(f"{out.error.code}: {out.error.message}")
    if as_json:
        sys.stdout.write(
            orjson.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens},
                }
            ).decode()
            + "\n"
        )
    else:
        click.echo(out.text)
