"""vLLM (CPU build) offline throughput on prompts given as token ids.

Run with the vLLM virtual environment's Python, not jaxserve's:

    .venv-vllm/bin/python benchmarks/peers/vllm_offline.py \
        --model FOLDER --prompts prompts.json --output-len 128

``prompts.json`` is a JSON list of token-id lists (the driver,
``benchmarks/bench/scenarios/offline.py``, writes it). Greedy decoding, exactly
``--output-len`` new tokens per prompt (EOS ignored), prefix caching off (the
warm-up runs the same prompts, and a cache hit would skip the timed run's
prefill). One warm-up ``generate`` of every prompt for a few tokens, then the
timed ``generate``; prints one ``@@bench {...}`` JSON line.

``--serve`` keeps the model loaded and times a run per ``run K`` command
on stdin (the driver's interleaving; see ``common.py``).

CPU settings, unless already set in the environment:

- ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB): 64 sequences of 256 tokens need
  64 x 256 x 8 layers x 2 x 4 heads x 64 x 4 bytes = 128 MiB.
- ``VLLM_CPU_OMP_THREADS_BIND``: ``--threads-bind``, default ``0-1`` (both
  cores for the model's OpenMP threads). vLLM's own default, ``auto``,
  reserves one of the two cores for its engine-core process and computes on
  the other; the driver can measure either.
"""

from __future__ import annotations

import os
import time

from common import load_prompts, peer_arguments, serve_or_once


def main() -> None:
    parser = peer_arguments(__doc__.splitlines()[0])
    parser.add_argument(
        "--threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND ('auto', 'nobind', or a cpu list such as 0-1)"
    )
    parser.add_argument("--kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kvcache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.threads_bind)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    prompts, input_len = load_prompts(args.prompts)
    num_prompts = len(prompts)

    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype="float32",
        max_model_len=max(input_len + args.output_len, 64),
        max_num_seqs=max(num_prompts, 1),
        enable_prefix_caching=False,
        seed=0,
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    warm = SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens, ignore_eos=True)
    llm.generate(inputs, warm, use_tqdm=False)
    startup_s = time.perf_counter() - started

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    first = {}

    def run() -> int:
        outputs = llm.generate(inputs, params, use_tqdm=False)
        first["ids"] = list(outputs[0].outputs[0].token_ids[:8])
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    base = {
        "system": "vllm",
        "version": vllm.__version__,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": args.output_len,
        "startup_s": round(startup_s, 2),
        "settings": {
            "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "dtype": "float32",
            "max_num_seqs": max(num_prompts, 1),
            "enable_prefix_caching": False,
        },
        "first_output_ids": first,
    }
    serve_or_once(base, run, num_prompts * args.output_len, args.serve, args.repeats)


if __name__ == "__main__":
    main()
