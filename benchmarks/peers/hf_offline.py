"""transformers' batched ``generate`` offline throughput on token-id prompts.

Runs in jaxserve's virtual environment (which has torch and transformers):

    .venv/bin/python benchmarks/peers/hf_offline.py \
        --model FOLDER --prompts prompts.json --output-len 128

``prompts.json`` is a JSON list of token-id lists, all the same length (so
one batch needs no padding). Greedy, exactly ``--output-len`` new tokens
(``min_new_tokens`` = ``max_new_tokens``), float32, the default dynamic KV
cache, ``torch.inference_mode``. One warm-up ``generate`` of the whole batch
for a few tokens, then the timed one; prints one ``@@bench {...}`` JSON line.
Torch uses ``--threads`` intra-op threads (default: every logical CPU).
``--serve``: see ``common.py``.
"""

from __future__ import annotations

import os
import time

from common import load_prompts, peer_arguments, serve_or_once


def main() -> None:
    parser = peer_arguments(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    prompts, input_len = load_prompts(args.prompts)
    num_prompts = len(prompts)

    started = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    input_ids = torch.tensor(prompts, dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)

    def generate(new_tokens: int):
        with torch.inference_mode():
            return model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )

    generate(args.warmup_tokens)
    startup_s = time.perf_counter() - started
    first = {}

    def run() -> int:
        out = generate(args.output_len)
        first["ids"] = out[0, input_len : input_len + 8].tolist()
        return (out.shape[1] - input_len) * out.shape[0]

    base = {
        "system": "transformers",
        "version": transformers.__version__,
        "torch": torch.__version__,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": args.output_len,
        "startup_s": round(startup_s, 2),
        "settings": {"threads": args.threads, "dtype": "float32", "cache": "default (dynamic)"},
        "first_output_ids": first,
    }
    serve_or_once(base, run, num_prompts * args.output_len, args.serve, args.repeats)


if __name__ == "__main__":
    main()
