"""The Python part of ``benchmarks/device_check.sh``: decode speed and HBM share on an accelerator.

    python benchmarks/device_check.py --out OUT/device_check.json [--junit OUT/kernel_tests.xml]
    python benchmarks/device_check.py --cpu-smoke            # dry run on the CPU, tiny model, seconds

What it measures, on the ``llama-1b`` preset's shapes (16 layers, hidden
2048, 32/8 heads, head_dim 64, intermediate 8192, vocab 32000: 1.10 B
parameters) with random bfloat16 weights drawn on the device (no download,
no checkpoint written):

- **decode steps** at 1 and 64 sequences, every sequence at ``--context``
  tokens (its KV blocks in the cache; their contents do not matter to the
  speed), through jaxserve's ``ModelRunner`` exactly as the engine drives
  it (forward program with the greedy pick inside, donated KV cache), once
  per attention kernel: the one ``attention_backend="auto"`` picks (the
  shipped Pallas GPU kernel on a GPU) and the pure-JAX reference. Three
  timings per case, medians of ``--repeats``:
  ``host_sync_step_ms`` (build arrays, launch, wait for the tokens: a
  synchronous engine step), ``pipelined_step_ms`` (each step launched on
  the previous one's device tokens, as with async scheduling) and
  ``device_step_ms`` (the compiled program called back to back on
  device-resident inputs: the device's own step time). ``tok_s`` =
  sequences / step time.
- **HBM share**: bytes one decode step must read (every weight once except
  the embedding table, of which only the step's rows; plus each sequence's
  keys and values, ``context`` positions x layers x kv heads x head_dim x
  2) / ``device_step_ms`` / the device's peak bandwidth (by
  ``jax.devices()[0].device_kind``: H200 4.8 TB/s, H100 SXM 3.35 TB/s, ...;
  ``--peak-bandwidth`` overrides), and against the bandwidth of a plain
  copy measured here (``copy_bandwidth``).
- **engine smoke**: ``LLM("tiny")`` with ``attention_backend`` auto and
  reference, a few greedy prompts end to end (the engine, the scheduler, the
  heads-layout cache); token agreement is reported, not asserted (the tiny
  preset's flat random logits make near ties).

Everything is written to ``--out`` as JSON (and printed). A part that fails
records its error and the rest still runs; a part that would pass
``--budget-s`` is skipped and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: peak HBM bandwidth, bytes/s, by a substring of ``device_kind`` (first match wins)
PEAK_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("H800", 3.35e12),
    ("GH200", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10", 0.6e12),
    ("TPU v5 lite", 0.819e12),
    ("TPU v5p", 2.765e12),
    ("TPU v4", 1.2e12),
]

STARTED = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - STARTED


def ensure_structlog() -> str:
    """The engine logs through structlog; the GPU image lacks it (no network
    there): a do-nothing stand-in for this process only."""
    try:
        import structlog  # noqa: F401

        return "installed"
    except ImportError:
        module = types.ModuleType("structlog")

        class _Quiet:
            def __getattr__(self, name):
                return lambda *args, **kwargs: None

        module.get_logger = lambda *args, **kwargs: _Quiet()
        sys.modules["structlog"] = module
        return "stub (not installed)"


def environment() -> dict:
    import jax
    import jaxlib

    out = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
    }
    try:
        from importlib import metadata

        out["packages"] = {
            name: metadata.version(name)
            for name in (
                "flax",
                "numpy",
                "jax-cuda12-plugin",
                "jax-cuda13-plugin",
                "jax-cuda12-pjrt",
                "jax-cuda13-pjrt",
                "triton",
                "tokenizers",
                "structlog",
                "pytest",
            )
            if _has_dist(metadata, name)
        }
    except Exception as exc:  # noqa: BLE001 - informational
        out["packages"] = repr(exc)
    try:
        stats = jax.devices()[0].memory_stats() or {}
        out["memory_bytes_limit"] = stats.get("bytes_limit")
    except Exception:  # noqa: BLE001 - backends without memory stats
        out["memory_bytes_limit"] = None
    return out


def _has_dist(metadata, name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def peak_bandwidth(kind: str, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "--peak-bandwidth"
    for key, value in PEAK_BANDWIDTH:
        if key.lower() in kind.lower():
            return value, f"datasheet ({key})"
    return None, f"unknown device kind {kind!r}: pass --peak-bandwidth"


def copy_bandwidth(num_bytes: int) -> dict:
    """Bytes read + written per second by a jitted ``x + 1`` over a bfloat16 array."""
    import jax
    import jax.numpy as jnp

    n = num_bytes // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: a + 1)
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"array_bytes": 2 * n, "best_s": best, "bytes_per_s": 2 * 2 * n / best}


def model_config(preset: str, overrides: dict | None = None):
    from jaxserve import presets
    from jaxserve.models.config import ModelConfig

    path = presets.presets_dir() / f"{preset}.json"
    data = presets.load_preset(path)
    config = presets.build_config(data, 0, 1)
    config.update(overrides or {})
    return ModelConfig.from_dict(config, source=str(path))


def build_model(cfg, dtype):
    from flax import nnx

    from jaxserve.models.decoder import CausalLM

    return CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))


def read_bytes_per_step(cfg, model, batch: int, context: int, cache_itemsize: int) -> dict:
    import jax
    import numpy as np

    weights = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(nnx_state(model)))
    itemsize = model.dtype.itemsize
    embed = cfg.vocab_size * cfg.hidden_size * itemsize
    if cfg.tie_word_embeddings:
        weight_read = weights  # the table is read whole as lm_head
    else:
        weight_read = weights - embed + batch * cfg.hidden_size * itemsize
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * cache_itemsize
    return {"weights": weight_read, "kv": kv, "total": weight_read + kv, "weight_bytes_total": weights}


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


def make_runner(model, cfg, impl, *, max_num_seqs: int, context: int, block_size: int, dtype):
    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.runner import ModelRunner

    model.attention = impl
    blocks_per_seq = -(-(context + 1) // block_size)
    return ModelRunner(
        model,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        num_blocks=max_num_seqs * blocks_per_seq + 1,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs,
        max_model_len=blocks_per_seq * block_size,
        cache_dtype=dtype,
        buckets=Buckets(tokens=tuple(sorted({8, max_num_seqs})), seqs=(max_num_seqs,)),
    )


def _row():
    from jaxserve.engine.sampler import SamplingRow
    from jaxserve.sampling_params import SamplingParams

    return SamplingRow(SamplingParams(temperature=0.0))


def decode_case(runner, batch: int, context: int, steps: int, repeats: int) -> dict:
    """Decode steps of ``batch`` sequences at ``context`` tokens each."""
    import jax
    import jax.numpy as jnp

    from jaxserve.engine.runner import SeqWork

    per_seq = runner.max_blocks_per_seq
    blocks = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    work = [SeqWork([3 + i], context - 1, blocks[i], sampling=_row()) for i in range(batch)]
    pending = [SeqWork([0], context - 1, blocks[i], sampling=_row(), pending_row=i) for i in range(batch)]

    def sync_once():
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.execute(work).fetch()
        return (time.perf_counter() - t0) / steps

    def pipelined_once():
        result = runner.execute(work)
        t0 = time.perf_counter()
        for _ in range(steps):
            result = runner.execute(pending, prev_tokens=result.tokens)
        result.fetch()
        return (time.perf_counter() - t0) / steps

    # the compiled forward program alone, on device-resident inputs
    bucket = runner.buckets.token_bucket(batch)
    compiled = runner._forward[bucket]
    captured = {}

    def spy(*args):
        captured["args"] = args
        return compiled(*args)

    runner._forward[bucket] = spy
    try:
        first = runner.execute(work).fetch()[0]
    finally:
        runner._forward[bucket] = compiled
    state, _, *rest = captured["args"]
    rest = jax.tree.map(jnp.asarray, rest)

    def device_once():
        cache = runner.kv_cache
        tokens = None
        t0 = time.perf_counter()
        for _ in range(steps):
            _, cache, tokens = compiled(state, cache, *rest)
        jax.block_until_ready(tokens)
        runner.kv_cache = cache
        return (time.perf_counter() - t0) / steps

    sync_once(), pipelined_once(), device_once()  # warm-up
    sync = statistics.median(sync_once() for _ in range(repeats))
    pipe = statistics.median(pipelined_once() for _ in range(repeats))
    dev = statistics.median(device_once() for _ in range(repeats))
    return {
        "batch": batch,
        "context": context,
        "token_bucket": bucket,
        "steps": steps,
        "repeats": repeats,
        "host_sync_step_ms": round(sync * 1e3, 4),
        "pipelined_step_ms": round(pipe * 1e3, 4),
        "device_step_ms": round(dev * 1e3, 4),
        "tok_s_host_sync": round(batch / sync, 1),
        "tok_s_pipelined": round(batch / pipe, 1),
        "tok_s_device": round(batch / dev, 1),
        "first_tokens": [int(t) for t in first[: min(batch, 8)]],
    }


def run_decode(args, results: dict, save=lambda: None) -> None:
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels.backends import REFERENCE, AttentionImpl, select_attention

    dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
    overrides = {"num_hidden_layers": 2} if args.cpu_smoke else None
    cfg = model_config(args.preset, overrides)
    model = build_model(cfg, dtype)
    jax.block_until_ready(nnx_state(model))
    auto, reason = select_attention(
        "auto",
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads,
        block_size=args.block_size,
        sliding_window=cfg.effective_sliding_window,
        cache_dtype=dtype,
    )
    impls = {"auto": auto, "reference": REFERENCE}
    if args.cpu_smoke:
        # the GPU-specific path through the runner, its kernel interpreted on the CPU
        impls["pallas-gpu-interpret"] = AttentionImpl(kernel="gpu", interpret=True)
    peak, peak_source = peak_bandwidth(jax.devices()[0].device_kind, args.peak_bandwidth)
    copy_bw = results.get("copy_bandwidth", {}).get("bytes_per_s")
    decode = results.setdefault("decode", {})
    results["model"] = {
        "preset": args.preset,
        "dtype": jnp.dtype(dtype).name,
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "parameters": sum(int(p.size) for p in jax.tree.leaves(nnx_state(model))),
        "auto_attention": auto.kernel,
        "auto_reason": reason,
        "block_size": args.block_size,
    }
    results["peak_bandwidth"] = {"bytes_per_s": peak, "source": peak_source}
    max_seqs = max(args.batches)
    for name, impl in impls.items():
        if name == "reference" and auto == REFERENCE:
            decode[name] = {"same_as": "auto"}
            continue
        if elapsed() > args.budget_s:
            decode[name] = {"skipped": f"time budget of {args.budget_s} s spent ({elapsed():.0f} s)"}
            continue
        entry = decode.setdefault(name, {"kernel": impl.kernel, "layout": impl.layout})
        runner = None
        try:
            t0 = time.perf_counter()
            runner = make_runner(
                model, cfg, impl, max_num_seqs=max_seqs, context=args.context, block_size=args.block_size, dtype=dtype
            )
            runner.warmup()
            entry["compile_s"] = round(time.perf_counter() - t0, 2)
            for batch in args.batches:
                if elapsed() > args.budget_s:
                    entry[str(batch)] = {"skipped": f"time budget of {args.budget_s} s spent"}
                    continue
                case = decode_case(runner, batch, args.context, args.steps, args.repeats)
                moved = read_bytes_per_step(cfg, model, batch, args.context, jnp.dtype(dtype).itemsize)
                seconds = case["device_step_ms"] / 1e3
                case["bytes_read_per_step"] = moved
                case["achieved_bytes_per_s"] = round(moved["total"] / seconds)
                case["hbm_share_of_peak"] = None if peak is None else round(moved["total"] / seconds / peak, 4)
                case["share_of_copy_bandwidth"] = None if not copy_bw else round(moved["total"] / seconds / copy_bw, 4)
                entry[str(batch)] = case
                save()
                print(
                    f"[device_check] decode {name} batch {batch}: {case['device_step_ms']} ms/step on device, "
                    f"{case['tok_s_device']} tok/s, share of peak {case['hbm_share_of_peak']}",
                    flush=True,
                )
        except Exception as exc:  # noqa: BLE001 - record and go on
            entry["error"] = repr(exc)
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"[device_check] decode {name} failed: {exc!r}", flush=True)
        finally:
            del runner
            gc.collect()
    firsts = {
        name: {b: v.get("first_tokens") for b, v in d.items() if isinstance(v, dict)}
        for name, d in decode.items()
        if isinstance(d, dict)
    }
    results["decode_first_tokens"] = firsts
    summary = results.setdefault("summary", {})
    for name, d in decode.items():
        for batch in args.batches:
            case = d.get(str(batch)) if isinstance(d, dict) else None
            if isinstance(case, dict) and "device_step_ms" in case:
                summary[f"{name}_batch{batch}"] = {
                    key: case[key]
                    for key in (
                        "tok_s_device",
                        "tok_s_pipelined",
                        "tok_s_host_sync",
                        "device_step_ms",
                        "hbm_share_of_peak",
                        "share_of_copy_bandwidth",
                    )
                }


def run_engine_smoke(args, results: dict, save=lambda: None) -> None:
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    smoke = results.setdefault("engine_smoke", {})
    prompts = ["The capital of France is", "def fibonacci(n):", "Queues and workers", "Hello"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("auto", "reference"):
        if elapsed() > args.budget_s:
            smoke[backend] = {"skipped": f"time budget of {args.budget_s} s spent"}
            continue
        try:
            t0 = time.perf_counter()
            llm = LLM("tiny", attention_backend=backend, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            tokens[backend] = [o.token_ids for o in outs]
            smoke[backend] = {
                "attention": llm.engine.attention.kernel,
                "cache_layout": llm.engine.runner.kv_cache.layout,
                "startup_s": round(start - t0, 2),
                "generate_s": round(time.perf_counter() - start, 3),
                "errors": [repr(o.error) for o in outs if o.error is not None],
                "completion_tokens": [o.completion_tokens for o in outs],
                "steps": llm.engine.num_steps,
            }
            del llm
            gc.collect()
        except Exception as exc:  # noqa: BLE001 - record and go on
            smoke[backend] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
        save()
    if len(tokens) == 2:
        pairs = [(a, b) for ra, rb in zip(tokens["auto"], tokens["reference"]) for a, b in zip(ra, rb)]
        smoke["token_agreement"] = round(sum(a == b for a, b in pairs) / max(1, len(pairs)), 4)


def junit_summary(path: str | None, rc: str | None) -> dict | None:
    if not path:
        return None
    out: dict = {"junit": path, "pytest_exit_code": None if rc in (None, "") else int(rc)}
    try:
        import xml.etree.ElementTree as ET

        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        for key in ("tests", "failures", "errors", "skipped", "time"):
            out[key] = suite.get(key)
        failed = []
        for case in suite.iter("testcase"):
            for tag in ("failure", "error"):
                node = case.find(tag)
                if node is not None:
                    failed.append({"test": case.get("name"), tag: (node.get("message") or "")[:500]})
        out["failed"] = failed
    except Exception as exc:  # noqa: BLE001 - a missing or broken file is reported
        out["read_error"] = repr(exc)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/device_check.json)")
    parser.add_argument("--cpu-smoke", action="store_true", help="dry run on the CPU: 2 layers, float32, small sizes")
    parser.add_argument("--preset", default=None, help="model shapes (default llama-1b; tiny with --cpu-smoke)")
    parser.add_argument("--batches", default=None, help="comma-separated sequence counts (default 1,64; 1,8 smoke)")
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence (default 512; 64 smoke)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="steps per timing (default 50; 3 smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-bandwidth", type=float, default=None, help="bytes/s (default: by device kind)")
    parser.add_argument("--budget-s", type=float, default=230.0, help="skip parts that would start after this")
    parser.add_argument("--junit", default=None, help="pytest junit XML of the kernel tests, summarised")
    parser.add_argument("--pytest-rc", default=None, help="the kernel tests' exit code")
    parser.add_argument("--no-engine-smoke", action="store_true")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.preset = args.preset or ("tiny" if smoke else "llama-1b")
    args.batches = [int(b) for b in (args.batches or ("1,8" if smoke else "1,64")).split(",")]
    args.context = args.context or (64 if smoke else 512)
    args.steps = args.steps or (3 if smoke else 50)
    if smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "."), "device_check.json"))
    os.environ.setdefault("JAXSERVE_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "jaxserve-device-check"))

    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_smoke": smoke}
    results["structlog"] = ensure_structlog()
    results["kernel_tests"] = junit_summary(args.junit, args.pytest_rc)

    def save():
        results["elapsed_s"] = round(elapsed(), 2)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=2, default=str) + "\n")

    try:
        results["env"] = environment()
        print("[device_check] env " + json.dumps(results["env"], default=str), flush=True)
        results["copy_bandwidth"] = copy_bandwidth(64 << 20 if smoke else 2 << 30)
        save()
        run_decode(args, results, save)
        save()
        if not args.no_engine_smoke:
            run_engine_smoke(args, results, save)
    except Exception as exc:  # noqa: BLE001 - the JSON says what broke
        results["fatal"] = {"error": repr(exc), "traceback": traceback.format_exc()[-6000:]}
    save()
    print(json.dumps(results, indent=2, default=str), flush=True)
    print(f"[device_check] wrote {out_path} in {elapsed():.1f} s", flush=True)
    return 1 if "fatal" in results else 0


if __name__ == "__main__":
    sys.exit(main())
