"""jaxserve offline throughput with the model kept loaded between timed runs.

    .venv/bin/python benchmarks/peers/jaxserve_offline.py \
        --model FOLDER --prompts prompts.json --output-len 128 [--quantization int8] [--serve]

The same engine, settings and warm-up as ``jaxserve bench offline``
(``LLM(model, max_num_seqs=min(prompts, 256), max_model_len=max(input +
output, 64), enable_prefix_caching=False)``, one 16-token warm-up request),
on the driver's prompts, which are the ones the CLI draws itself (same
recipe and seed). The CLI builds a fresh engine per run; this script exists
so the driver can interleave jaxserve's timed runs tightly with the other
systems' (``--serve``, see ``common.py``).

Speculative decoding is off unless ``--num-speculative-tokens`` says
otherwise: the peers (llama.cpp's batched bench, vLLM) decode one token per
step, and random-weight models (offline-moe) collapse to repeating one token,
which prompt lookup guesses every time (offline-moe-2026-12-07T035114Z.json:
2.0x llama.cpp and "151 % of read bandwidth" with it on), so the figure
would measure the guesser, not the engine. The ``speculative`` scenario
measures speculation on workloads where it is meant to help.
"""

from __future__ import annotations

import time

from common import load_prompts, peer_arguments, serve_or_once


def main() -> None:
    parser = peer_arguments(__doc__.splitlines()[0], warmup_tokens=False)
    parser.add_argument("--quantization", default=None, help="int8 or int4 (weight-only, as the CLI's --quantization)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0, help="guesses per step (default 0: off)")
    args = parser.parse_args()

    prompts, input_len = load_prompts(args.prompts)
    num_prompts = len(prompts)

    started = time.perf_counter()
    import jaxserve
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.worker.logs import configure_logging

    configure_logging(level="warning")
    llm = LLM(
        args.model,
        max_num_seqs=min(num_prompts, 256),
        max_model_len=max(input_len + args.output_len, 64),
        enable_prefix_caching=False,
        num_speculative_tokens=args.num_speculative_tokens,
        **({"quantization": args.quantization} if args.quantization else {}),
    )
    llm.generate([prompts[0][: min(16, input_len)]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    startup_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    first = {}

    def run() -> int:
        outputs = llm.generate(prompts, params)
        first["ids"] = list(outputs[0].token_ids[:8])
        return sum(o.completion_tokens for o in outputs)

    base = {
        "system": "jaxserve",
        "version": getattr(jaxserve, "__version__", "dev"),
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": args.output_len,
        "startup_s": round(startup_s, 2),
        "compile_s": round(llm.engine.compile_seconds, 2),
        "settings": {
            "max_num_seqs": min(num_prompts, 256),
            "max_num_batched_tokens": llm.engine.scheduler_config.max_num_batched_tokens,
            "block_size": llm.engine.scheduler_config.block_size,
            "num_blocks": llm.engine.num_blocks,
            "enable_prefix_caching": False,
            "num_speculative_tokens": args.num_speculative_tokens,
            "quantization": args.quantization,
        },
        "first_output_ids": first,
    }
    serve_or_once(base, run, num_prompts * args.output_len, args.serve, args.repeats)


if __name__ == "__main__":
    main()
