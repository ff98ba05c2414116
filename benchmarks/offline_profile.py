"""Where jaxserve's offline time goes: host phases, device programs, components.

    .venv/bin/python benchmarks/offline_profile.py [--num-prompts 64] [--json OUT]

Three views of the ``jaxserve bench offline`` workload (same engine settings,
same prompts), in one process, nothing in the engine edited (timers are
wrapped around its methods on the instance):

1. **Step phases.** The real run, every ``Engine.step`` split into
   ``schedule`` (scheduler), ``execute_host`` (building the step's numpy
   arrays), ``dispatch`` (calling the compiled forward and sampler),
   ``wait`` (``StepResult.fetch``: the device finishing), ``update``
   (``Scheduler.update_from_output``), ``detokenize`` (``Engine.process``,
   where it exists) and ``other_host`` (the rest of the step). Steps are
   split into prefill-carrying steps and pure decode steps by the plan they
   dispatch (the engine pipelines: a step waits for the previous one).
2. **Device programs.** Synthetic decode steps at the run's batch size and
   mean context, and a full prefill chunk, timed through
   ``ModelRunner.execute`` + ``fetch`` (median of several); decode steps
   also with no row sampling (the forward program alone), and the host
   part alone (the compiled programs stubbed out).
3. **Components**, each its own jitted program on the model's own weights,
   to compare with (2): the dense matmuls of the layers alone (no attention,
   no cache), the vocabulary projection, paged attention over the cache for
   all layers, and the KV write carried through a scan over layers. Their
   sum against the real forward shows what the fused program loses.

4. **Experiments** (``--experiments``): alternatives to what the engine
   does, each next to its baseline: the scores matmul with keys laid out
   ``[C, D]`` vs ``[D, C]``; decode attention with the cache as now vs keys
   stored transposed per block; the sampler's greedy path vs a plain argmax;
   ``lax.scan`` over stacked layer weights vs one array per layer.

The machine's matmul rate for the same shapes is the yardstick: the
component times are also reported as GFLOP/s.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _median_time(fn, repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------- 1. step phases


def profile_steps(llm, prompts, output_len) -> dict:
    from jaxserve.engine import runner as runner_mod
    from jaxserve.sampling_params import SamplingParams

    engine = llm.engine
    runner = engine.runner
    acc: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    current = {"kind": "decode"}

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[current["kind"]][key] += time.perf_counter() - t0

        return wrapper

    orig_schedule = engine.scheduler.schedule

    def schedule():
        t0 = time.perf_counter()
        plan = orig_schedule()
        prefill = any(len(s.token_ids) > 1 for s in plan.scheduled) if not plan.is_empty else False
        current["kind"] = "prefill" if prefill else "decode"
        acc[current["kind"]]["schedule"] += time.perf_counter() - t0
        if not plan.is_empty:
            acc[current["kind"]]["tokens"] += sum(len(s.token_ids) for s in plan.scheduled)
            acc[current["kind"]]["sampled"] += sum(1 for s in plan.scheduled if s.sample)
        return plan

    engine.scheduler.schedule = schedule
    for table, key in ((runner._forward, "dispatch"), (runner._sample, "dispatch"), (runner._greedy, "dispatch")):
        for bucket in list(table):
            table[bucket] = timed(table[bucket], key)
    orig_execute = runner.execute
    runner.execute = timed(orig_execute, "execute_total")
    orig_fetch = runner_mod.StepResult.fetch
    runner_mod.StepResult.fetch = timed(orig_fetch, "wait")
    orig_step = engine.step

    def step():
        t0 = time.perf_counter()
        out = orig_step()
        acc[current["kind"]]["step_total"] += time.perf_counter() - t0
        acc[current["kind"]]["steps"] += 1
        return out

    engine.step = step
    # Finer host phases where the engine has them (names may change; skipped if absent).
    patched = []
    for obj, name, key in ((engine.scheduler, "update_from_output", "update"), (engine, "process", "detokenize")):
        if hasattr(obj, name):
            patched.append((obj, name, getattr(obj, name)))
            setattr(obj, name, timed(getattr(obj, name), key))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        engine.step = orig_step
        runner.execute = orig_execute
        runner_mod.StepResult.fetch = orig_fetch
        engine.scheduler.schedule = orig_schedule
        for obj, name, fn in patched:
            setattr(obj, name, fn)
    generated = sum(o.completion_tokens for o in outputs)
    phases = {}
    for kind, d in acc.items():
        d = dict(d)
        d["execute_host"] = d.get("execute_total", 0.0) - d.get("dispatch", 0.0)
        d["other_host"] = d.get("step_total", 0.0) - sum(
            d.get(k, 0.0) for k in ("schedule", "execute_total", "wait", "update", "detokenize")
        )
        d.pop("execute_total", None)
        phases[kind] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}
        if d.get("steps"):
            phases[kind]["ms_per_step"] = round(1000 * d["step_total"] / d["steps"], 2)
    return {
        "wall_s": round(wall, 3),
        "output_tokens": generated,
        "output_tokens_per_s": round(generated / wall, 2),
        "phases": phases,
        "outside_steps_s": round(wall - sum(d.get("step_total", 0.0) for d in acc.values()), 4),
    }


# ------------------------------------------------------- 2. device programs


def _decode_work(num_seqs, context, block_size, first_block=1):
    from jaxserve.engine.runner import SeqWork

    blocks_per_seq = -(-(context + 1) // block_size)
    work = []
    for i in range(num_seqs):
        blocks = list(range(first_block + i * blocks_per_seq, first_block + (i + 1) * blocks_per_seq))
        work.append(SeqWork(token_ids=[7], start_pos=context, block_ids=blocks, sampling=_greedy_row()))
    return work


def _greedy_row():
    from jaxserve.engine.sampler import SamplingRow
    from jaxserve.sampling_params import SamplingParams

    return SamplingRow(SamplingParams(temperature=0.0))


def profile_programs(llm, num_seqs, contexts, prefill_tokens) -> dict:
    import dataclasses

    import jax

    from jaxserve.engine.runner import SeqWork

    runner = llm.engine.runner
    bs = runner.block_size
    out = {}

    def run(work):
        res = runner.execute(work)
        res.fetch()

    def run_forward(work):
        runner.execute(work)
        jax.block_until_ready(runner.kv_cache)

    for ctx in contexts:
        work = _decode_work(num_seqs, ctx, bs)
        out[f"decode_{num_seqs}x_ctx{ctx}_ms"] = round(1000 * _median_time(lambda work=work: run(work)), 2)
        # No row samples: the forward program alone (the difference is the sampler's program).
        silent = [dataclasses.replace(w, sampling=None) for w in work]
        out[f"decode_{num_seqs}x_ctx{ctx}_forward_only_ms"] = round(
            1000 * _median_time(lambda silent=silent: run_forward(silent)), 2
        )
        # The host part alone: build the arrays, skip the device.
        out[f"decode_{num_seqs}x_ctx{ctx}_host_ms"] = round(
            1000 * _median_time(lambda work=work: _host_only(runner, work)), 3
        )
    # One prefill chunk of prefill_tokens tokens from as many 128-token prompts as fit.
    per = 128
    n = max(1, min(runner.max_num_seqs, prefill_tokens // per))
    blocks_per_seq = -(-per // bs)
    work = [
        SeqWork(
            token_ids=[7] * per,
            start_pos=0,
            block_ids=list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)),
            sampling=_greedy_row(),
        )
        for i in range(n)
    ]
    out[f"prefill_{n}x{per}_ms"] = round(1000 * _median_time(lambda: run(work), repeats=5), 2)
    return out


def _host_only(runner, work):
    """``execute`` with the compiled programs swapped for stubs: host array building only."""
    import jax.numpy as jnp

    fwd, smp, grd = runner._forward, runner._sample, runner._greedy
    kv = runner.kv_cache
    dummy = {s: (jnp.zeros(s, jnp.int32), jnp.zeros(s, jnp.float32)) for s in smp}
    try:
        tokens = {t: jnp.zeros(runner.max_num_seqs, jnp.int32) for t in fwd}
        runner._forward = {t: (lambda *a, t=t: (None, kv, tokens[t])) for t in fwd}
        runner._sample = {s: (lambda *a, s=s: dummy[s]) for s in smp}
        runner._greedy = {key: (lambda *a, s=key[0]: dummy[s]) for key in grd}
        runner.execute(work)
    finally:
        runner._forward, runner._sample, runner._greedy = fwd, smp, grd
        runner.kv_cache = kv


# ------------------------------------------------------------ 3. components


def profile_components(llm, num_seqs, context, prefill_tokens) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.engine.sampler import argmax as greedy_argmax
    from jaxserve.kernels.attention_metadata import AttentionMetadata
    from jaxserve.kernels.paged_attention import paged_attention, write_kv

    engine = llm.engine
    runner = engine.runner
    cfg = engine.model_config
    model = nnx.merge(runner.graphdef, runner.state)
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    w = {k: jnp.stack([layer.arrays()[k] for layer in model.layers]) for k in names}  # [L, ...] copies
    lm_head = model.output_embedding()  # [vocab, hidden]
    H, KVH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E = cfg.hidden_size
    layer_flops_per_token = 2 * sum(int(np.prod(w[k].shape[1:])) for k in names)
    layer_flops_per_token *= cfg.num_hidden_layers
    out = {}

    def dense_layers(x, w):
        # the model's orientation: weights [out, in], activations [features, T]
        def body(h, lw):
            qkv = jnp.dot(lw["wqkv"], h)
            o = jnp.dot(lw["wo"], qkv[: H * D])
            h = h + o
            g, u = jnp.split(jnp.dot(lw["w_gate_up"], h), 2, axis=0)
            return h + jnp.dot(lw["w_down"], jax.nn.silu(g) * u), None

        h, _ = jax.lax.scan(body, x, w)
        return h

    dense = jax.jit(dense_layers)
    head = jax.jit(lambda x, wh: greedy_argmax(jnp.dot(wh, x.T), axis=0))
    for t in (num_seqs, prefill_tokens):
        x = jnp.ones((E, t), jnp.float32) * 0.01
        s = _median_time(lambda x=x: dense(x, w).block_until_ready())
        out[f"dense_layers_T{t}_ms"] = round(1000 * s, 2)
        out[f"dense_layers_T{t}_gflop_s"] = round(t * layer_flops_per_token / s / 1e9, 1)
    x = jnp.ones((num_seqs, E), jnp.float32) * 0.01
    s = _median_time(lambda: head(x, lm_head).block_until_ready())
    out[f"lm_head_argmax_T{num_seqs}_ms"] = round(1000 * s, 2)
    out[f"lm_head_argmax_T{num_seqs}_gflop_s"] = round(2 * num_seqs * E * cfg.vocab_size / s / 1e9, 1)

    # Paged attention for every layer over the engine's cache (read only here).
    kv = runner.kv_cache
    bs = runner.block_size
    M = runner.max_blocks_per_seq
    blocks_per_seq = -(-(context + 1) // bs)
    bt = np.zeros((runner.max_num_seqs, M), np.int32)
    for i in range(num_seqs):
        bt[i, :blocks_per_seq] = np.arange(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)
    positions = np.full(num_seqs, context, np.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(bt[np.arange(num_seqs), context // bs] * bs + context % bs),
        token_seq=jnp.arange(num_seqs, dtype=jnp.int32),
        block_tables=jnp.asarray(bt),
        context_lens=jnp.asarray(np.where(np.arange(runner.max_num_seqs) < num_seqs, context + 1, 0), np.int32),
        logits_indices=jnp.zeros(runner.max_num_seqs, jnp.int32),
    )
    q = jnp.ones((num_seqs, H, D), jnp.float32) * 0.01

    def attn_all_layers(q, k_all, v_all, meta, positions):
        def body(acc, i):
            o = paged_attention(
                q, k_all, v_all, meta, positions, block_size=bs, scale=D**-0.5, layer=i, cache_dtype=kv.dtype
            )
            return acc + o, None

        acc, _ = jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(cfg.num_hidden_layers))
        return acc

    attn = jax.jit(attn_all_layers)
    k_all, v_all = kv.stacked()  # the gathering kernel over a stacked copy of the cache
    s = _median_time(lambda: attn(q, k_all, v_all, meta, jnp.asarray(positions)).block_until_ready())
    out[f"paged_attention_all_layers_T{num_seqs}_ctx{context}_ms"] = round(1000 * s, 2)

    # The KV write carried through a scan over layers, cache donated: what the
    # forward pays to keep the whole cache in its scan carry.
    def write_all_layers(k_all, v_all, slots):
        new = jnp.ones((num_seqs, KVH, D), k_all.dtype)

        def body(carry, i):
            k_all, v_all = carry
            k_all, v_all = write_kv(k_all, v_all, new, new, slots, layer=i, cache_dtype=kv.dtype)
            return (k_all, v_all), None

        (k_all, v_all), _ = jax.lax.scan(body, (k_all, v_all), jnp.arange(cfg.num_hidden_layers))
        return k_all, v_all

    write = jax.jit(write_all_layers, donate_argnums=(0, 1))
    state = {"k": k_all, "v": v_all}

    def do_write():
        state["k"], state["v"] = write(state["k"], state["v"], meta.slot_mapping)
        state["v"].block_until_ready()

    s = _median_time(do_write)
    out[f"kv_write_all_layers_T{num_seqs}_ms"] = round(1000 * s, 3)
    out["kv_cache_mib"] = round(kv.nbytes / 2**20, 1)
    return out


# ----------------------------------------------------------- 4. experiments


def profile_experiments(num_seqs: int = 64, context: int = 192) -> dict:
    """Alternatives to what the engine does now, on synthetic data of the
    llama-56m shapes (8 layers, hidden 512, 8/4 heads of 64, intermediate
    1408, vocab 32000), each against its baseline in the same process."""
    import jax
    import jax.numpy as jnp

    from jaxserve.engine.sampler import SamplingTensors, host_sampling_tensors, sample

    L, E, I, V, KVH, G, D, BS = 8, 512, 1408, 32000, 4, 2, 64, 16
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)  # noqa: E731
    timed = lambda f, *a: round(1000 * _median_time(lambda: jax.block_until_ready(f(*a)), repeats=9), 2)  # noqa: E731
    out = {}

    # (a) The scores matmul: keys as [C, D] (contracting both minor dims) or as [D, C].
    B = num_seqs * KVH
    q, k_cd, k_dc = normal(B, G, D), normal(B, context, D), normal(B, D, context)
    out["qk_scores_keys_C_by_D_ms"] = timed(jax.jit(lambda q, k: jnp.einsum("bgd,bcd->bgc", q, k)), q, k_cd)
    out["qk_scores_keys_D_by_C_ms"] = timed(jax.jit(lambda q, k: q @ k), q, k_dc)

    # (b) Decode attention over all layers, gathering whole blocks: the cache
    # as now ([slot, kvh, D]) vs keys stored transposed per block ([kvh, D, BS])
    # and values head-major per block ([kvh, BS, D]).
    nb = -(-(context + 1) // BS)
    num_blocks = num_seqs * nb + 1
    bt = jnp.asarray(1 + np.arange(num_seqs * nb).reshape(num_seqs, nb), jnp.int32)
    qd = normal(num_seqs, KVH, G, D)
    k_now, v_now = normal(L, num_blocks, BS, KVH, D), normal(L, num_blocks, BS, KVH, D)
    k_t, v_h = jnp.transpose(k_now, (0, 1, 3, 4, 2)), jnp.transpose(v_now, (0, 1, 3, 2, 4))

    def attn_now(q, kc, vc, bt):
        def body(acc, i):
            kk = kc[i, bt].reshape(num_seqs, -1, KVH, D)
            vv = vc[i, bt].reshape(num_seqs, -1, KVH, D)
            p = jax.nn.softmax(jnp.einsum("skgd,sckd->skgc", q, kk), axis=-1)
            return acc + jnp.einsum("skgc,sckd->skgd", p, vv), None

        return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(L))[0]

    def attn_transposed(q, kc, vc, bt):
        def body(acc, i):
            s = jnp.einsum("skgd,snkdc->skgnc", q, kc[i, bt]).reshape(num_seqs, KVH, G, -1)
            p = jax.nn.softmax(s, axis=-1).reshape(num_seqs, KVH, G, nb, BS)
            return acc + jnp.einsum("skgnc,snkcd->skgd", p, vc[i, bt]), None

        return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(L))[0]

    a, b = jax.jit(attn_now), jax.jit(attn_transposed)
    out["decode_attention_layout_now_ms"] = timed(a, qd, k_now, v_now, bt)
    out["decode_attention_keys_transposed_ms"] = timed(b, qd, k_t, v_h, bt)
    out["decode_attention_max_abs_diff"] = float(jnp.max(jnp.abs(a(qd, k_now, v_now, bt) - b(qd, k_t, v_h, bt))))
    del k_now, v_now, k_t, v_h

    # (c) Greedy sampling: the engine's sample() (two lax.conds) vs argmax + the chosen logprob.
    rows = [_greedy_row()] * num_seqs
    tensors = SamplingTensors(**{k: jnp.asarray(v) for k, v in host_sampling_tensors(rows, num_seqs, 256).items()})
    h, w = normal(num_seqs, E), normal(E, V)

    def greedy(h, w):
        logits = h @ w
        tokens = jnp.argmax(logits, axis=-1)
        return tokens, jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]

    out["lm_head_plus_sample_ms"] = timed(jax.jit(lambda h, w, t: sample(h @ w, t)), h, w, tensors)
    out["lm_head_plus_greedy_ms"] = timed(jax.jit(greedy), h, w)

    # (d) The layers' matmuls: lax.scan over stacked [L, ...] weights vs one
    # array per layer (a Python loop at trace time), at 1, 8 (the smallest
    # token bucket) and num_seqs rows.
    stacked = {
        "wqkv": normal(L, E, 1024),
        "wo": normal(L, 512, E),
        "w_gate_up": normal(L, E, 2 * I),
        "w_down": normal(L, I, E),
    }
    per_layer = [{k: v[i] for k, v in stacked.items()} for i in range(L)]

    def layer(h, lw):
        h = h + (h @ lw["wqkv"])[:, :512] @ lw["wo"]
        g, u = jnp.split(h @ lw["w_gate_up"], 2, axis=-1)
        return h + (jax.nn.silu(g) * u) @ lw["w_down"]

    def loop(x, ws):
        for lw in ws:
            x = layer(x, lw)
        return x

    scanned = jax.jit(lambda x, w: jax.lax.scan(lambda h, lw: (layer(h, lw), None), x, w)[0])
    looped = jax.jit(loop)
    for t in sorted({1, 8, num_seqs}):
        x = jnp.ones((t, E), jnp.float32) * 0.01
        out[f"layers_T{t}_scan_stacked_ms"] = timed(scanned, x, stacked)
        out[f"layers_T{t}_per_layer_arrays_ms"] = timed(looped, x, per_layer)
    return out


# -------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--quantization", choices=["int8", "int4"], default=None, help="weights as --quantization loads them"
    )
    parser.add_argument("--skip-components", action="store_true")
    parser.add_argument(
        "--experiments",
        action="store_true",
        help="also time alternatives (attention layout, greedy sampler, scan vs per-layer weights)",
    )
    parser.add_argument("--trace", default=None, help="also write a jax.profiler trace of a short run here")
    parser.add_argument("--json", default=None, help="write the result here too")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    from bench.scenarios.offline import make_prompts
    from jaxserve.engine.llm import LLM
    from jaxserve.presets import resolve_model
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.worker.logs import configure_logging

    configure_logging(level="warning")
    folder = Path(resolve_model(args.model))
    n = args.num_prompts
    t0 = time.perf_counter()
    llm = LLM(
        str(folder),
        max_num_seqs=min(n, 256),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(args.input_len + args.output_len, 64),
        enable_prefix_caching=False,
        quantization=args.quantization,
    )
    startup = time.perf_counter() - t0
    prompts = make_prompts(folder, n, args.input_len)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    from bench.machine import git_state

    result = {
        "git": git_state(),
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
        "num_prompts": n,
        "quantization": args.quantization,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "startup_s": round(startup, 2),
        "compile_s": round(llm.engine.compile_seconds, 2),
        "token_buckets": list(llm.engine.runner.buckets.tokens),
        "max_num_batched_tokens": llm.engine.scheduler_config.max_num_batched_tokens,
    }
    result["steps"] = profile_steps(llm, prompts, args.output_len)
    mean_ctx = args.input_len + args.output_len // 2
    prefill_tokens = result["max_num_batched_tokens"]
    result["programs"] = profile_programs(llm, n, sorted({args.input_len, mean_ctx}), prefill_tokens)
    if not args.skip_components:
        result["components"] = profile_components(llm, n, mean_ctx, prefill_tokens)
    if args.experiments:
        result["experiments"] = profile_experiments(n, mean_ctx)
    if args.trace:
        import jax

        with jax.profiler.trace(args.trace):
            llm.generate(prompts[: min(n, 8)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        result["trace_dir"] = args.trace
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
