"""jaxserve decode throughput over long contexts, with the model kept loaded between timed runs.

    .venv/bin/python benchmarks/peers/jaxserve_kv_decode.py \
        --model FOLDER --prompts prompts.json --output-len 64 --kv-cache-dtype int8 [--serve]

One engine as ``jaxserve bench offline`` builds it (``LLM(model,
max_num_seqs=<prompts>, max_model_len=input + output, enable_prefix_caching=False,
kv_cache_dtype=...)``). A run adds every prompt at once and steps the engine
to the end; the figure is the *decode* rate: the tokens generated after
every request has its first token, over the time from that step to the
last. Prefill (the whole of a prompt's 1,024 tokens, as many steps as the
step budget needs) is left out: it writes the cache, and what the cache's
dtype changes is how fast decode steps read it back. The result also
records the cache's bytes per token (``KVCacheSize``).

Protocol: ``common.py`` (``--serve``: ``ready``, then one ``result`` per
``run K`` with the median of K runs).
"""

from __future__ import annotations

import statistics
import time

from common import emit, load_prompts, peer_arguments, serve_commands


def main() -> None:
    parser = peer_arguments(__doc__.splitlines()[0], warmup_tokens=False)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's), float32, bfloat16 or int8")
    parser.add_argument("--quantization", default=None, help="int8 or int4 weights (as the CLI's --quantization)")
    args = parser.parse_args()

    prompts, input_len = load_prompts(args.prompts)
    started = time.perf_counter()
    import jaxserve
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.worker.logs import configure_logging

    configure_logging(level="warning")
    llm = LLM(
        args.model,
        max_num_seqs=len(prompts),
        max_model_len=input_len + args.output_len,
        enable_prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
        **({"quantization": args.quantization} if args.quantization else {}),
    )
    engine = llm.engine
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    startup_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    runs = 0

    def run() -> dict:
        nonlocal runs
        runs += 1
        ids = [f"kv-{runs}-{i}" for i in range(len(prompts))]
        t_start = time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        seen: set[str] = set()
        total = 0
        t0 = tokens0 = None
        first: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                total += len(out.new_token_ids)
                if out.new_token_ids:
                    seen.add(out.request_id)
                if out.finished and out.request_id == ids[0]:
                    first[:] = out.token_ids[:16]
            if t0 is None and len(seen) == len(ids):  # every prompt prefilled: decode from here
                t0, tokens0 = time.perf_counter(), total
        end = time.perf_counter()
        if total != len(prompts) * args.output_len or t0 is None or tokens0 is None:
            raise RuntimeError(f"expected {len(prompts) * args.output_len} tokens, generated {total}")
        decode_tokens = total - tokens0
        return {
            "decode_tok_s": decode_tokens / (end - t0),
            "decode_tokens": decode_tokens,
            "decode_s": end - t0,
            "prefill_s": t0 - t_start,
            "first_output_ids": first,
        }

    size = engine.kv_cache_size
    base = {
        "system": "jaxserve",
        "version": getattr(jaxserve, "__version__", "dev"),
        "num_prompts": len(prompts),
        "input_len": input_len,
        "output_len": args.output_len,
        "startup_s": round(startup_s, 2),
        "compile_s": round(engine.compile_seconds, 2),
        "settings": {
            "kv_cache_dtype": size.dtype,
            "kv_bytes_per_token": size.bytes_per_token,
            "kv_cache_bytes": engine.runner.kv_cache.nbytes,
            "num_blocks": engine.num_blocks,
            "block_size": size.block_size,
            "attention": engine.attention.kernel,
            "quantization": args.quantization,
        },
    }

    def result(count: int) -> dict:
        turns = [run() for _ in range(count)]
        rates = [t["decode_tok_s"] for t in turns]
        return {
            "event": "result",
            **base,
            "output_tokens_per_s": round(statistics.median(rates), 2),
            "runs_tok_s": [round(r, 2) for r in rates],
            "decode_s": [round(t["decode_s"], 3) for t in turns],
            "prefill_s": [round(t["prefill_s"], 3) for t in turns],
            "decode_tokens": turns[-1]["decode_tokens"],
            "first_output_ids": turns[-1]["first_output_ids"],
        }

    if not args.serve:
        emit(result(args.repeats))
        return
    serve_commands(base, lambda args: result(int(args[0]) if args else 1))


if __name__ == "__main__":
    main()
