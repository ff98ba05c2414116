"""Capacity arithmetic: how many workers, how many sequences each, how much KV.

Notation (every quantity is printed with its value by :meth:`Plan.text`):

    lam        arrival rate, jobs/s (``rps``);  U = 1 - headroom
    Lp, Lp95   prompt tokens, mean and p95;     Lo, Lo95  output tokens
    C, P       prefill chunk (step budget) and the prefill rate there, tokens/s
    D(b)       decode tokens/s of a batch of b sequences, read at the p95
               sequence length Lp95 + Lo95 (profile: linear between the
               measured batch sizes and contexts, flat outside them; a step's
               attention grows with its longest sequence, so the p95 one)
    ITL(b)     b / D(b): the time of one decode step of b sequences, which is
               each sequence's inter-token latency

1. **Sequences per worker** (``max_num_seqs``) b* = min(b_itl, b_kv, b_sat):

   - b_sat: the measured batch with the highest D (a bigger one adds no
     throughput: the *decode compute* ceiling);
   - b_itl: the largest b such that ITL(1..b) all meet the ITL target;
   - b_kv: KV memory M per worker holds floor(M / block bytes) blocks, one
     of them the null block; a sequence at p95 length needs
     ceil((Lp95 + Lo95) / block_size) blocks, so
     b_kv = floor((blocks - 1) / blocks per sequence). The cache must also
     hold one request of ``max_model_len``.

2. **Compute**. A job costs a worker Lp / P seconds of prefill and
   Lo / D(b*) seconds of decode (its share of full decode steps). Both
   share the worker's time, so workers >= lam x (Lp/P + Lo/D(b*)) / U.
   The larger share names the budget: *prefill compute*, or for decode the
   reason D(b*) is what it is (*decode compute* when b* = b_sat, else
   *ITL* or *KV memory*).

3. **TTFT**. A job arriving waits for the running step (ITL(b*)), then its
   prefill: a p95 prompt takes Lp95 / P. A worker that gets k prompts of a
   burst at once finishes the k-th after ITL(b*) + k x Lp95 / P, so it can
   take k = floor((ttft_target - ITL(b*)) / (Lp95 / P)) of them, and a
   burst of B needs B / k workers. The steady arrivals' queueing is what
   the headroom is for.

4. **Queue path** (with ``--scaleout``): a worker's event loop is one core;
   at c CPU seconds per job, workers >= lam x c / U. One broker carries
   ``workers_per_broker`` workers (scale-out efficiency >= the threshold)
   and ``broker jobs/s per core x broker_cores`` jobs/s x U.

workers = max(1, ceil of each requirement); the *binding* budget is the one
with the largest requirement. Everything else is reported alongside.

Not modelled: prefill chunks sharing steps with decodes (ITL is higher in
steps that carry a prefill), prefix-cache hits (they make prefill cheaper),
requests beyond the p95 lengths (they take more blocks; the scheduler
preempts when the cache runs out), and the interactive reserve (batch jobs
may use only ``max_num_seqs - interactive_reserved_seqs`` sequences).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.planning.profile import Profile
from jaxserve.planning.scaleout import ScaleoutLimits
from jaxserve.planning.workload import PlanWorkload

#: labels of the budgets, as reported in ``binding``
BUDGETS = ("prefill compute", "decode compute", "KV memory", "TTFT", "ITL", "worker event loop")

_EPS = 1e-9


class PlanInfeasible(ValueError):
    """No number of workers meets the workload's targets on this profile.
    ``budget`` names the budget that cannot be met."""

    def __init__(self, budget: str, message: str) -> None:
        super().__init__(f"{budget}: {message}")
        self.budget = budget


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    kv_memory_bytes: int | None = None  # per worker; default: device memory x memory_fraction - weights
    memory_fraction: float = 0.9
    chunk: int | None = None  # prefill chunk = step budget; default: the profile's fastest
    max_model_len: int | None = None  # default: the profile's (the model's default)
    scaleout: ScaleoutLimits | None = None
    broker_cores: float = 1.0


@dataclasses.dataclass
class Plan:
    workers: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int
    binding: str
    budgets: dict[str, float | None]  # raw worker requirements (before rounding up)
    derived: dict[str, Any]
    lines: list[str]
    brokers: int | None
    workload: PlanWorkload
    profile: Profile

    @property
    def worker_flags(self) -> str:
        return (
            f"--max-num-seqs {self.max_num_seqs} --max-num-batched-tokens {self.max_num_batched_tokens} "
            f"--kv-cache-memory {self.kv_cache_memory_bytes}"
        )

    def to_dict(self) -> dict[str, Any]:
        w = self.workload
        return {
            "workers": self.workers,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_cache_memory_bytes_per_worker": self.kv_cache_memory_bytes,
            "binding": self.binding,
            "brokers": self.brokers,
            "worker_flags": self.worker_flags,
            "budgets_workers": self.budgets,
            "derived": self.derived,
            "workload": {
                "rps": w.rps,
                "burst": w.burst,
                "prompt_tokens": {"mean": w.prompt_tokens.mean, "p95": w.prompt_tokens.p95},
                "output_tokens": {"mean": w.output_tokens.mean, "p95": w.output_tokens.p95},
                "ttft_target_s": w.ttft_target_s,
                "itl_target_s": w.itl_target_s,
                "headroom": w.headroom,
            },
            "profile": {"model": self.profile.model, "machine": self.profile.meta.get("machine")},
            "lines": self.lines,
        }

    def text(self) -> str:
        out = list(self.lines)
        out += [
            "",
            f"workers               {self.workers}   (binding: {self.binding})",
            f"max_num_seqs          {self.max_num_seqs}",
            f"KV memory per worker  {_mib(self.kv_cache_memory_bytes)} ({self.kv_cache_memory_bytes} bytes)",
        ]
        if self.brokers is not None:
            out.append(f"brokers               {self.brokers}")
        out.append(f"worker flags          {self.worker_flags}")
        return "\n".join(out)


def _g(x: float) -> str:
    return f"{x:.6g}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _ceil(x: float) -> int:
    """Ceiling that ignores float noise just above an integer."""
    return math.ceil(x - _EPS)


def _floor(x: float) -> int:
    """Floor that ignores float noise just below an integer."""
    return math.floor(x + _EPS)


def make_plan(workload: PlanWorkload, profile: Profile, options: PlanOptions | None = None) -> Plan:
    """The plan (see the module docstring); raises :class:`PlanInfeasible`."""
    opt = options or PlanOptions()
    w = workload
    lines: list[str] = []
    say = lines.append
    U = 1.0 - w.headroom
    lam = float(w.rps)
    Lp, Lp95 = w.prompt_tokens.mean, w.prompt_tokens.p95
    Lo, Lo95 = w.output_tokens.mean, w.output_tokens.p95
    say(
        f"workload: lam = {_g(lam)} jobs/s, burst {w.burst}; prompt tokens {w.prompt_tokens}; output tokens {w.output_tokens}"
    )
    say(
        f"          headroom {_g(w.headroom)} -> usable U = 1 - {_g(w.headroom)} = {_g(U)}; "
        f"TTFT target {'-' if w.ttft_target_s is None else _g(w.ttft_target_s) + ' s'}; "
        f"ITL target {'-' if w.itl_target_s is None else _g(w.itl_target_s) + ' s'}"
    )
    machine = profile.meta.get("machine") or {}
    method = profile.meta.get("method") or {}
    say(
        f"profile:  {profile.model} on {machine.get('backend', '?')} ({machine.get('device_kind') or machine.get('cpu_model') or '?'}); "
        f"KV {profile.kv_bytes_per_token} B/token, blocks of {profile.block_size} tokens = {profile.block_bytes} B"
        + (f"; sampled at temperature {method['temperature']}" if "temperature" in method else "")
    )

    # ---------------------------------------------------------- prefill rate
    C = int(opt.chunk or profile.best_chunk)
    P = profile.prefill_rate(C)
    measured = "measured" if C in profile.prefill else "interpolated"
    say(
        f"prefill:  C = {C}-token chunks, P = {_g(P)} tokens/s ({measured}; measured: "
        + ", ".join(f"{c}: {_g(r)}" for c, r in sorted(profile.prefill.items()))
        + ")"
    )

    # ------------------------------------------------------ sequences / worker
    ctx95 = Lp95 + Lo95
    b_sat = profile.saturation_batch(ctx95)
    say(
        f"decode:   at the p95 sequence length Lp95 + Lo95 = {_g(ctx95)} tokens (measured contexts "
        + ", ".join(str(c) for c in profile.contexts)
        + "): "
        + ", ".join(
            f"D({b}) = {_g(profile.decode_rate(b, ctx95))} (ITL {_g(profile.itl(b, ctx95))} s)" for b in profile.batches
        )
    )
    say(f"          b_sat = {b_sat} (the measured batch with the highest D)")
    b_itl: int | None = None
    if w.itl_target_s is not None:
        itl1 = profile.itl(1, ctx95)
        if itl1 > w.itl_target_s + _EPS:
            raise PlanInfeasible(
                "ITL",
                f"one sequence alone decodes at ITL(1) = {_g(itl1)} s > the target {_g(w.itl_target_s)} s on this profile",
            )
        for b in range(1, b_sat + 1):
            if profile.itl(b, ctx95) > w.itl_target_s + _EPS:
                b_itl = b - 1
                break
        if b_itl is None:
            say(f"ITL:      ITL(b) <= {_g(w.itl_target_s)} s for every b <= b_sat: no ITL limit below b_sat")
        else:
            say(
                f"ITL:      ITL({b_itl}) = {_g(profile.itl(b_itl, ctx95))} s <= {_g(w.itl_target_s)} s < ITL({b_itl + 1}) = "
                f"{_g(profile.itl(b_itl + 1, ctx95))} s -> b_itl = {b_itl}"
            )

    block = profile.block_size
    blocks_seq = math.ceil(ctx95 / block - _EPS)
    mml = int(opt.max_model_len or profile.max_model_len or math.ceil(ctx95))
    if ctx95 > mml:
        raise PlanInfeasible(
            "KV memory",
            f"a p95 request ({_g(Lp95)} + {_g(Lo95)} = {_g(ctx95)} tokens) exceeds max_model_len {mml}: raise --max-model-len",
        )
    blocks_mml = math.ceil(mml / block)
    if opt.kv_memory_bytes is not None:
        M = int(opt.kv_memory_bytes)
        say(f"KV:       memory per worker M = {M} B (given)")
    elif profile.device_memory_bytes:
        M = int(profile.device_memory_bytes * opt.memory_fraction) - int(profile.weight_bytes)
        say(
            f"KV:       memory per worker M = {profile.device_memory_bytes} B x {_g(opt.memory_fraction)} - "
            f"{profile.weight_bytes} B weights = {M} B"
        )
    else:
        raise PlanInfeasible("KV memory", "the profile has no device memory: give --kv-memory")
    budget_blocks = M // profile.block_bytes
    say(f"          blocks = floor({M} / {profile.block_bytes}) = {budget_blocks} (one is the null block)")
    if budget_blocks - 1 < blocks_mml:
        raise PlanInfeasible(
            "KV memory",
            f"{budget_blocks - 1} usable blocks cannot hold one request of max_model_len {mml} ({blocks_mml} blocks): "
            f"give more --kv-memory or a smaller --max-model-len",
        )
    b_kv = (budget_blocks - 1) // blocks_seq
    say(
        f"          a p95 sequence: {_g(Lp95)} + {_g(Lo95)} = {_g(ctx95)} tokens = ceil({_g(ctx95)} / {block}) = {blocks_seq} blocks"
    )
    say(f"          b_kv = floor(({budget_blocks} - 1) / {blocks_seq}) = {b_kv}")
    if b_kv < 1:
        raise PlanInfeasible("KV memory", f"M = {M} B does not hold one p95 sequence ({blocks_seq} blocks)")
    candidates = [("decode compute", b_sat)]
    if b_itl is not None:
        candidates.append(("ITL", b_itl))
    candidates.append(("KV memory", b_kv))
    b_star = min(b for _, b in candidates)
    limiter = next(name for name, b in candidates if b == b_star)
    D = profile.decode_rate(b_star, ctx95)
    itl_star = b_star / D
    say(
        "max_num_seqs b* = min("
        + ", ".join(
            f"{'b_sat' if n == 'decode compute' else 'b_itl' if n == 'ITL' else 'b_kv'} {b}" for n, b in candidates
        )
        + f") = {b_star} (set by {limiter}); D(b*) = {_g(D)} tokens/s, ITL(b*) = {b_star} / {_g(D)} = {_g(itl_star)} s"
    )

    # ---------------------------------------------------------------- compute
    s_p = Lp / P
    s_d = Lo / D
    s = s_p + s_d
    W_p = lam * s_p / U
    W_d = lam * s_d / U
    W_c = W_p + W_d
    say(
        f"compute:  per job prefill Lp / P = {_g(Lp)} / {_g(P)} = {_g(s_p)} s, decode Lo / D(b*) = {_g(Lo)} / {_g(D)} = {_g(s_d)} s, "
        f"total s = {_g(s)} worker-s"
    )
    say(
        f"          workers >= lam x s / U = {_g(lam)} x {_g(s)} / {_g(U)} = {_g(W_c)} "
        f"(prefill {_g(W_p)} + decode {_g(W_d)})"
    )

    # ------------------------------------------------------------------- TTFT
    W_t: float | None = None
    k: int | None = None
    t_prompt = Lp95 / P
    if w.ttft_target_s is not None:
        room = w.ttft_target_s - itl_star
        k = _floor(room / t_prompt) if room > 0 else 0
        if k < 1:
            raise PlanInfeasible(
                "TTFT",
                f"a p95 prompt alone takes ITL(b*) + Lp95 / P = {_g(itl_star)} + {_g(t_prompt)} = {_g(itl_star + t_prompt)} s "
                f"> the target {_g(w.ttft_target_s)} s on this profile",
            )
        W_t = w.burst / k
        say(
            f"TTFT:     a p95 prompt's prefill Lp95 / P = {_g(Lp95)} / {_g(P)} = {_g(t_prompt)} s after a step of {_g(itl_star)} s"
        )
        say(
            f"          k = floor(({_g(w.ttft_target_s)} - {_g(itl_star)}) / {_g(t_prompt)}) = {k} burst prompts per worker; "
            f"workers >= burst / k = {w.burst} / {k} = {_g(W_t)}"
        )

    # ------------------------------------------------------------- queue path
    W_l: float | None = None
    sc = opt.scaleout
    if sc is not None and sc.loop_cpu_s_per_job:
        W_l = lam * sc.loop_cpu_s_per_job / U
        say(
            f"loop:     event-loop CPU {_g(sc.loop_cpu_s_per_job * 1e3)} ms/job (scale-out run): "
            f"workers >= {_g(lam)} x {_g(sc.loop_cpu_s_per_job)} / {_g(U)} = {_g(W_l)}"
        )

    raw: dict[str, float | None] = {"compute": W_c, "TTFT": W_t, "worker event loop": W_l}
    workers = max([1] + [_ceil(v) for v in raw.values() if v is not None])
    top = max(((n, v) for n, v in raw.items() if v is not None), key=lambda nv: nv[1])[0]
    if top == "compute":
        binding = "prefill compute" if s_p >= s_d else limiter
    else:
        binding = top
    say(
        "workers = max(1, "
        + ", ".join(f"ceil({_g(v)}) {n}" for n, v in raw.items() if v is not None)
        + f") = {workers}; binding: {binding}"
    )

    # ------------------------------------------------------------ per worker
    kv_blocks = max(b_star * blocks_seq, blocks_mml) + 1
    kv_bytes = kv_blocks * profile.block_bytes
    say(
        f"KV/worker: max(b* x {blocks_seq} = {b_star * blocks_seq}, {blocks_mml} for max_model_len {mml}) + 1 = {kv_blocks} blocks x "
        f"{profile.block_bytes} B = {kv_bytes} B ({_mib(kv_bytes)})"
    )
    max_batched = max(C, b_star)
    cap_compute = 1.0 / s
    cap = cap_compute
    if sc is not None and sc.loop_cpu_s_per_job:  # as for W_l above
        cap = min(cap, 1.0 / sc.loop_cpu_s_per_job)
    t_job = itl_star + s_p + Lo * itl_star
    in_flight = lam / workers * t_job
    say(
        f"capacity: one worker completes 1 / s = {_g(cap_compute)} jobs/s at 100 % ({_g(cap_compute * Lo)} output tokens/s), "
        f"{_g(cap * U)} jobs/s at U" + ("" if cap == cap_compute else f" (event loop: {_g(cap)} jobs/s at 100 %)")
    )
    say(
        f"          a job takes about ITL(b*) + Lp / P + Lo x ITL(b*) = {_g(t_job)} s; in flight per worker "
        f"lam / workers x that = {_g(in_flight)} of {b_star} sequences"
    )

    brokers: int | None = None
    derived_broker: dict[str, Any] = {}
    if sc is not None:
        by_workers = _ceil(workers / sc.workers_per_broker)
        brokers = by_workers
        say(
            f"brokers:  {sc.workers_per_broker} workers per broker (scale-out efficiency >= {_g(sc.efficiency)}): "
            f"ceil({workers} / {sc.workers_per_broker}) = {by_workers}"
        )
        if sc.broker_jobs_per_s_per_core:
            limit = sc.broker_jobs_per_s_per_core * opt.broker_cores
            by_rate = _ceil(lam / (U * limit))
            brokers = max(by_workers, by_rate)
            say(
                f"          a broker carries {_g(sc.broker_jobs_per_s_per_core)} jobs/s per core x {_g(opt.broker_cores)} core(s) "
                f"= {_g(limit)} jobs/s: ceil({_g(lam)} / ({_g(U)} x {_g(limit)})) = {by_rate}; brokers = {brokers}"
            )
            derived_broker["broker_jobs_per_s"] = limit
        derived_broker["workers_per_broker"] = sc.workers_per_broker

    derived = {
        "usable": U,
        "chunk": C,
        "prefill_tokens_per_s": P,
        "b_sat": b_sat,
        "b_itl": b_itl,
        "b_kv": b_kv,
        "b_star": b_star,
        "b_star_limited_by": limiter,
        "decode_tokens_per_s_at_b_star": D,
        "itl_at_b_star_s": itl_star,
        "blocks_per_p95_sequence": blocks_seq,
        "kv_memory_budget_bytes": M,
        "kv_blocks_budget": budget_blocks,
        "max_model_len": mml,
        "prefill_s_per_job": s_p,
        "decode_s_per_job": s_d,
        "worker_s_per_job": s,
        "ttft_p95_prompt_prefill_s": t_prompt,
        "ttft_burst_prompts_per_worker": k,
        "capacity_jobs_per_s_per_worker": cap,
        "capacity_jobs_per_s_per_worker_at_headroom": cap * U,
        "capacity_output_tokens_per_s_per_worker": cap * Lo,
        "job_time_s": t_job,
        "in_flight_per_worker": in_flight,
        **derived_broker,
    }
    budgets = {"prefill compute": W_p, "decode compute": W_d, "compute": W_c, "TTFT": W_t, "worker event loop": W_l}
    return Plan(
        workers=workers,
        max_num_seqs=b_star,
        max_num_batched_tokens=max_batched,
        kv_cache_memory_bytes=kv_bytes,
        binding=binding,
        budgets=budgets,
        derived=derived,
        lines=lines,
        brokers=brokers,
        workload=w,
        profile=profile,
    )
