"""Speculative decoding (``jaxserve.engine.speculative``): the guesses, the
scheduler's books for them, and the engine's output with them, which must
be the output without them.

The engine tests run the engine-test checkpoint (``tests/engine_fixtures.py``:
logits large enough that greedy picks never hinge on a near tie, so two
programs that round differently still agree on every token) on two engines
alike but for ``num_speculative_tokens``, and compare every job's tokens,
text, finish reason and log-probabilities. The sampled-distribution test
runs the sampler itself on fixed logits."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import pytest
from jax import monitoring

from engine_fixtures import build_engine_checkpoint
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.block_allocator import hash_request_tokens
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.config import SchedulerConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.request import Request
from jaxserve.engine.sampler import SamplingRow, SamplingTensors, host_sampling_tensors, sample
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.speculative import (
    MISSES_BEFORE_PAUSE,
    PAUSE_STEPS,
    Drafter,
    NgramIndex,
    Proposal,
    SpeculativeConfig,
    accepted_run,
)
from jaxserve.sampling_params import SamplingParams, StructuredOutput

pytestmark = pytest.mark.timeout(1800)

# ---------------------------------------------------------------- guesses


def test_ngram_index_guesses_what_followed_the_latest_longest_match():
    tokens = [5, 6, 7, 8, 1, 2, 6, 7, 9, 3, 6, 7]
    index = NgramIndex(1, 3)
    # tail (6, 7): latest earlier occurrence at 6..7, followed by 9 3 6 7
    assert index.propose(tokens, len(tokens), 4) == [9, 3, 6, 7]
    # a longer tail wins over a shorter, later one: (2, 6, 7) occurs once
    tokens2 = [*tokens, 4, 1, 2, 6, 7]
    assert NgramIndex(1, 3).propose(tokens2, len(tokens2), 2) == [9, 3]
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4, 3) == []  # nothing repeats
    assert index.propose(tokens, len(tokens), 0) == []


def test_ngram_index_repeats_a_loop_with_its_period_and_ignores_a_pending_tail():
    loop = [4, 9, 4, 9, 4]
    assert NgramIndex(1, 2).propose(loop, len(loop), 5) == [9, 4, 9, 4, 9]
    # only the known tokens count: the last one (pending) is left out
    assert NgramIndex(1, 2).propose([*loop, -1], len(loop), 2) == [9, 4]


def test_ngram_index_reindexes_a_list_that_got_shorter():
    index = NgramIndex(1, 2)
    tokens = [1, 2, 3, 1, 2, 3, 1]
    assert index.propose(tokens, len(tokens), 2) == [2, 3]
    cut = [7, 8, 7]  # a recomputed request whose output was cut back and differs
    assert index.propose(cut, len(cut), 2) == [8, 7]


def test_accepted_run_keeps_guesses_while_they_equal_the_samples():
    assert accepted_run([4, 5, 6], [4, 5], set()) == [4, 5, 6]  # all kept, and the token after them
    assert accepted_run([4, 9, 6], [4, 5], set()) == [4, 9]  # second guess wrong: the sample replaces it
    assert accepted_run([8, 5, 6], [4, 5], set()) == [8]  # first guess wrong
    assert accepted_run([4, 5, 6], [4, 5], {4}) == [4]  # decoding stops at a stop token
    assert accepted_run([3], [], set()) == [3]


def test_the_drafter_spends_guesses_where_a_bucket_pays_for_them():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), Buckets.build(64, 8, single_token=True).tokens)
    sure = [Proposal(f"r{i}", [1, 2, 3], [0.9, 0.81, 0.73], 0) for i in range(8)]
    # one row: a 4-token step costs little more than a 1-token one
    assert drafter.choose(sure[:1], base_tokens=1, base_rows=1, max_tokens=64) == {"r0": [1, 2, 3]}
    # eight rows of likely guesses fill the 32-token bucket
    chosen = drafter.choose(sure, base_tokens=8, base_rows=8, max_tokens=64)
    assert sum(map(len, chosen.values())) == 24
    # unlikely guesses are not worth a bigger bucket for eight rows
    doubtful = [Proposal(f"r{i}", [1, 2], [0.1, 0.01], 0) for i in range(8)]
    assert drafter.choose(doubtful, base_tokens=8, base_rows=8, max_tokens=64) == {}
    # the room left is respected, and a row keeps a prefix of its guesses
    chosen = drafter.choose(sure[:2], base_tokens=2, base_rows=2, max_tokens=3)
    assert sum(map(len, chosen.values())) == 3 and all(v == [1, 2, 3][: len(v)] for v in chosen.values())


def test_a_guess_from_a_longer_match_is_worth_more():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), (1, 8))
    weak = drafter.propose(Request("w", [5, 1, 2, 3, 9, 7, 5], SamplingParams(max_tokens=50)), 2)
    strong = drafter.propose(Request("s", [1, 2, 3, 9, 1, 2, 3], SamplingParams(max_tokens=50)), 2)
    assert weak is not None and strong is not None
    assert (weak.tokens, weak.match, strong.tokens, strong.match) == ([1, 2], 1, [9, 1], 3)
    assert weak.values[0] < strong.values[0] and weak.values[1] < weak.values[0]


def test_a_row_whose_guesses_keep_failing_pauses_then_tries_again():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), (1, 8))
    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=50))
    start = drafter.alpha("r")

    def miss() -> None:
        proposal = drafter.propose(req, 3)
        assert proposal is not None and proposal.tokens == [3, 1, 2]
        drafter.drafted("r", proposal.tokens, proposal.num_forced)
        drafter.verified("r", 3, 0)

    for pause in (PAUSE_STEPS, 2 * PAUSE_STEPS):
        for _ in range(MISSES_BEFORE_PAUSE):
            miss()
        assert not drafter.may_propose(req)  # paused: its steps may overlap (async scheduling)
        assert [drafter.propose(req, 3) for _ in range(pause)] == [None] * pause
    assert drafter.alpha("r") < start / 2
    for _ in range(10):
        proposal = drafter.propose(req, 3)
        assert proposal is not None
        drafter.drafted("r", proposal.tokens, 0)
        drafter.verified("r", 3, 3)
    assert drafter.alpha("r") > 0.7
    assert (drafter.num_drafts, drafter.num_draft_tokens, drafter.num_accepted_tokens) == (16, 48, 30)


def test_limits_follow_the_job_the_engine_and_max_tokens():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), (1, 8))
    assert drafter.limit(Request("a", [1], SamplingParams(max_tokens=50))) == 4
    assert drafter.limit(Request("b", [1], SamplingParams(max_tokens=50, num_speculative_tokens=2))) == 2
    assert drafter.limit(Request("c", [1], SamplingParams(max_tokens=50, num_speculative_tokens=0))) == 0
    assert drafter.limit(Request("d", [1], SamplingParams(max_tokens=3))) == 2  # the last token is sampled


# ---------------------------------------------------------------- the scheduler's books


class FixedDrafter(Drafter):
    """Proposes what a test tells it, and every proposal is worth its cost."""

    def __init__(self) -> None:
        super().__init__(SpeculativeConfig(num_speculative_tokens=4, cost_doubling_tokens=1e9), (1, 8, 16, 64))
        self.guesses: dict[str, list[int]] = {}

    def propose(self, req, k):
        guess = self.guesses.get(req.request_id, [])[:k]
        return Proposal(req.request_id, guess, [1.0] * len(guess), 0) if guess else None


def _scheduler(num_blocks: int = 32, **overrides) -> tuple[Scheduler, FixedDrafter]:
    cfg = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        num_blocks=num_blocks,
        num_speculative_tokens=4,
        enable_prefix_caching=True,
    )
    cfg.update(overrides)
    drafter = FixedDrafter()
    return Scheduler(SchedulerConfig(**cfg), drafter=drafter), drafter


def test_rejected_guesses_roll_back_and_only_verified_blocks_are_cached():
    s, drafter = _scheduler()
    req = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=30))
    s.add_request(req)
    drafter.guesses["a"] = [7, 8, 9]
    plan = s.schedule()
    [row] = plan.scheduled
    assert row.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9] and row.draft_token_ids == [7, 8, 9]
    assert row.num_scheduled_tokens == 9 and row.num_logits_rows == 4 and len(row.block_ids) == 3
    # 7 and 8 kept, 9 rejected: the model sampled 50 after 8
    s.update_from_output(plan, {"a": [7, 8, 50]})
    assert req.output_token_ids == [7, 8, 50] and req.num_computed_tokens == 8 == req.num_tokens - 1
    assert len(req.block_ids) == 3  # the guess's block stays with the request

    def cached():
        return [s.allocator.block_hash(b) for b in req.block_ids[: req.num_registered_blocks]]

    assert cached() == hash_request_tokens(req.all_token_ids[:8], 4, req.cache_salt)
    drafter.guesses["a"] = [60, 61]  # both wrong
    plan = s.schedule()
    assert plan.scheduled[0].token_ids == [50, 60, 61]
    s.update_from_output(plan, {"a": [70]})
    assert req.num_computed_tokens == 9 and req.all_token_ids[-2:] == [50, 70]
    assert req.num_registered_blocks == 2  # block 3 holds the rejected guess's keys: not cached
    drafter.guesses.clear()
    for token in (71, 72, 73):
        plan = s.schedule()
        assert plan.scheduled[0].draft_token_ids == []
        s.update_from_output(plan, {"a": token})
    # positions 8..11 now hold verified tokens (the guess's keys were overwritten): cached
    assert req.num_computed_tokens == 12 and req.num_registered_blocks == 3
    assert cached() == hash_request_tokens(req.all_token_ids[:12], 4, req.cache_salt)


def test_a_run_must_fit_the_guesses_it_verified():
    s, drafter = _scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=30)))
    drafter.guesses["a"] = [4]
    plan = s.schedule()
    with pytest.raises(ValueError, match="1 guessed tokens"):
        s.update_from_output(plan, {"a": [4, 5, 6]})
    with pytest.raises(ValueError, match="no sampled token"):
        s.update_from_output(plan, {})
    s.update_from_output(plan, {"a": [4, 5]})


def test_guesses_take_only_spare_blocks_and_stay_within_max_tokens_and_the_context():
    # 7 usable blocks of 4 tokens: two requests of 11 tokens hold 6 of them
    s, drafter = _scheduler(num_blocks=8, max_model_len=28)
    a = Request("a", list(range(1, 11)), SamplingParams(max_tokens=18))
    b = Request("b", list(range(1, 11)), SamplingParams(max_tokens=3))
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": 11, "b": 11})
    drafter.guesses = {"a": [12, 13, 14, 15], "b": [12, 13, 14, 15]}
    plan = s.schedule()
    got = {r.request_id: r.draft_token_ids for r in plan.scheduled}
    # b may guess one token (its third is its last, sampled); a guesses within its own
    # blocks (the one free block is the spare every running request may need next step)
    assert got == {"a": [12], "b": [12]}
    assert s.num_preemptions == 0 and s.allocator.num_free_blocks == 1
    s.update_from_output(plan, {"a": [12, 13], "b": [12, 40]})
    assert b.is_finished and b.output_token_ids == [11, 12, 40]
    # near its end (max_tokens, here max_model_len too) a guess never runs the request past it
    drafter.guesses = {"a": list(range(100, 120))}
    for _ in range(20):
        if a.is_finished:
            break
        plan = s.schedule()
        [row] = plan.scheduled
        assert a.num_tokens + len(row.draft_token_ids) < 28
        s.update_from_output(plan, {"a": list(row.draft_token_ids) + [7]})
    assert a.is_finished and a.num_tokens == 28 and s.allocator.num_used_blocks == 0


def test_no_guesses_without_a_drafter_or_with_the_switch_off():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=32)
    )
    s.add_request(Request("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=10)))
    assert s.schedule().scheduled[0].draft_token_ids == []
    off, drafter = _scheduler(num_speculative_tokens=0)
    assert off.config.max_num_logits_rows == off.config.max_num_seqs
    off.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10)))
    drafter.guesses["a"] = [4, 5]
    assert off.schedule().scheduled[0].draft_token_ids == []


# ---------------------------------------------------------------- sampled distribution


def test_kept_guesses_leave_the_sampled_distribution_as_it_is():
    """The rule for a guess ``d`` (a point mass): sample ``x`` from the
    target at that position and keep ``d`` iff ``x == d``; otherwise emit
    ``x``. So the first new token is ``x ~ q0`` whatever was guessed (kept
    with probability ``q0(d)``, the standard rule's ``min(1, q/p)`` for
    ``p = 1``; else distributed as ``q0`` without ``d``, renormalized: the
    standard residual), and after a kept guess the next is ``~ q1``.

    Checked with the sampler itself over 6000 seeds, rows built as the
    engine builds them (``output_index`` moving on by the guesses before):
    the first token's counts against ``q0``, the second's (given the guess
    was kept) against ``q1``, each by Pearson's chi-square at p = 0.001
    (seeds are fixed, so the verdict is too; a rule off by a few percent of
    mass, e.g. accepting ``d`` with ``q0(d) + 0.03``, fails it at these
    counts), and the acceptance rate against ``q0(d)`` within four standard
    errors."""
    q0 = np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    q1 = np.array([0.05, 0.10, 0.40, 0.25, 0.15, 0.05])
    guess, n = 1, 6000
    logits = np.log(np.stack([q0, q1])).astype(np.float32)
    rows = []
    for seed in range(n):
        p = SamplingParams(temperature=1.0, seed=seed)
        rows += [SamplingRow(p, output_index=5), SamplingRow(p, output_index=6)]
    arrays = host_sampling_tensors(rows, len(rows), 0)
    tokens, _ = jax.jit(sample)(np.tile(logits, (n, 1)), SamplingTensors(**arrays))
    tokens = np.asarray(tokens).reshape(n, 2)
    runs = [accepted_run(t.tolist(), [guess], set()) for t in tokens]
    first = np.bincount([r[0] for r in runs], minlength=6)
    second = np.bincount([r[1] for r in runs if len(r) == 2], minlength=6)
    kept = sum(len(r) == 2 for r in runs)
    assert abs(kept / n - q0[guess]) < 4 * math.sqrt(q0[guess] * (1 - q0[guess]) / n)
    chi2_p001 = 20.52  # 5 degrees of freedom
    for counts, q in ((first, q0), (second, q1)):
        expected = q * counts.sum()
        assert ((counts - expected) ** 2 / expected).sum() < chi2_p001


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_engine_checkpoint(tmp_path_factory.mktemp("spec-ckpt"))


def _engine(checkpoint: Path, k: int, **overrides) -> Engine:
    args = dict(
        model=str(checkpoint),
        max_num_seqs=12,
        max_num_batched_tokens=96,
        max_model_len=160,
        block_size=16,
        kv_cache_memory=24 * 16 * 512,  # 24 blocks of 16 tokens (512 bytes per token): the batch preempts
        num_speculative_tokens=k,
        async_scheduling=False,
    )
    args.update(overrides)
    engine = Engine(EngineArgs(**args))
    engine.warmup()
    return engine


def _jobs(num: int, seed: int = 5) -> list[tuple[list[int], SamplingParams]]:
    """Varied jobs: prompts that repeat themselves (guesses get kept),
    random ones (nothing to copy), prompts sharing a prefix (prefix-cache
    hits); greedy rows plain and with stop strings, stop ids, a short
    max_tokens, logprobs with alternatives, penalties, a grammar, rows
    that turn speculation off, and seeded sampled rows."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(10, 500, size=40).tolist()
    jobs = []
    for i in range(num):
        kind = i % 5
        if kind == 0:
            phrase = rng.integers(10, 500, size=int(rng.integers(4, 12))).tolist()
            prompt = (phrase * 8)[: int(rng.integers(20, 70))]
        elif kind == 1:
            prompt = rng.integers(10, 500, size=int(rng.integers(3, 60))).tolist()
        elif kind == 2:
            prompt = shared + rng.integers(10, 500, size=int(rng.integers(1, 20))).tolist()
        elif kind == 3:
            body = rng.integers(10, 500, size=int(rng.integers(10, 30))).tolist()
            prompt = body + rng.integers(10, 500, size=5).tolist() + body[: int(rng.integers(2, 8))]
        else:
            prompt = (rng.integers(10, 60, size=6).tolist() * 5)[: int(rng.integers(8, 30))]
        style = (i // 5) % 10
        base = dict(max_tokens=int(rng.integers(12, 40)), temperature=0.0, ignore_eos=True)
        if style == 1:
            base.update(stop=("a", "the"), ignore_eos=False)
        elif style == 2:
            base.update(stop_token_ids=tuple(int(t) for t in rng.integers(10, 500, size=40)))
        elif style == 3:
            base.update(max_tokens=int(rng.integers(1, 6)))
        elif style == 4:  # the greedy program with logprobs, or the sampling program's alternatives
            base.update(logprobs=True, top_logprobs=3 if i % 2 else 0)
        elif style == 5:
            base.update(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
        elif style == 6:
            base.update(ignore_eos=False, structured=StructuredOutput("regex", "(ab|cd|ef)+x{3,9}"))
        elif style == 7:
            base.update(num_speculative_tokens=0)
        elif style == 8:
            base.update(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i, logprobs=True)
        elif style == 9:
            base.update(num_speculative_tokens=2, ignore_eos=False)
        jobs.append((prompt, SamplingParams(**base)))
    return jobs


def _serve(engine: Engine, jobs, stagger: int = 2) -> dict[str, dict]:
    """Feed the jobs a few per step and collect each final output."""
    done: dict[str, dict] = {}
    pending = list(enumerate(jobs))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % stagger == 0:
            for i, (prompt, params) in pending[:4]:
                engine.add_request(f"j{i}", prompt, params)
            pending = pending[4:]
        for out in engine.step():
            if out.finished:
                assert out.error is None, (out.request_id, out.error)
                done[out.request_id] = {
                    "ids": out.token_ids,
                    "text": out.text,
                    "finish": out.finish_reason,
                    "logprobs": out.logprobs,
                    "top": out.top_logprobs,
                }
        step += 1
    assert engine.allocator.num_used_blocks == 0
    return done


def _assert_same(plain: dict[str, dict], spec: dict[str, dict], atol: float = 1e-5) -> None:
    assert plain.keys() == spec.keys()
    for rid, want in plain.items():
        got = spec[rid]
        assert (got["ids"], got["text"], got["finish"]) == (want["ids"], want["text"], want["finish"]), rid
        assert (got["logprobs"] is None) == (want["logprobs"] is None), rid
        if want["logprobs"] is not None:
            # the same to float32 rounding (a few 1e-6): a position's logits come from a program of
            # another row count (the step's guesses are rows too), whose matmul may sum in another order
            np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=0, atol=atol, err_msg=rid)
        if want["top"] is not None:
            assert [[t for t, _ in alts] for alts in got["top"]] == [[t for t, _ in alts] for alts in want["top"]], rid


@pytest.fixture(scope="module")
def plain_engine(checkpoint):
    return _engine(checkpoint, 0)


@pytest.fixture(scope="module")
def spec_engine(checkpoint):
    return _engine(checkpoint, 4)


def test_outputs_with_guesses_equal_outputs_without_over_many_jobs(plain_engine, spec_engine):
    """250 jobs (see ``_jobs``) through both engines, four arriving every
    other step: every job's tokens, text, finish reason, log-probabilities
    and alternatives agree, while the speculative engine did guess, keep
    guesses, preempt and hit the prefix cache."""
    jobs = _jobs(250)
    plain = _serve(plain_engine, jobs)
    spec = _serve(spec_engine, jobs)
    _assert_same(plain, spec)
    drafter = spec_engine.drafter
    assert drafter is not None and drafter.num_draft_tokens > 200 and drafter.num_accepted_tokens > 100
    stats = spec_engine.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert spec_engine.num_steps < plain_engine.num_steps
    finishes = {out["finish"] for out in spec.values()}
    assert finishes == {"stop", "length"}


@pytest.fixture(scope="module")
def int8_engines(checkpoint):
    return _engine(checkpoint, 0, quantization="int8"), _engine(checkpoint, 4, quantization="int8")


def test_int8_outputs_with_guesses_are_the_same_bits_as_without(int8_engines):
    """With int8 weights every layer's product quantizes its input per
    token and block, so a last-bit difference in a position's activations
    can become another integer and, on a real model, another greedy token.
    A position's logits must therefore be the same bits whatever else its
    step holds (its own guesses, other rows): 100 jobs' tokens and
    log-probabilities, exactly (and on a real model:
    tests/test_speculative_smollm2.py)."""
    plain_engine, spec_engine = int8_engines
    jobs = _jobs(100, seed=11)
    plain = _serve(plain_engine, jobs)
    spec = _serve(spec_engine, jobs)
    _assert_same(plain, spec, atol=0.0)
    drafter = spec_engine.drafter
    assert drafter is not None and drafter.num_accepted_tokens > 50


def test_seeded_sampling_with_guesses_is_the_text_without_them(plain_engine, spec_engine):
    """A seeded job draws position ``i``'s token with ``fold_in(seed, i)``
    from the target distribution whether or not the position was guessed,
    and a guess is kept only when it equals that draw: so the text is the
    one decoding without guesses gives, run after run."""
    rng = np.random.default_rng(11)
    jobs = []
    for i in range(40):
        phrase = rng.integers(10, 80, size=3).tolist()
        params = SamplingParams(max_tokens=24, temperature=0.7, top_k=8, seed=500 + i, ignore_eos=True)
        if i % 3 == 0:
            params = SamplingParams(max_tokens=24, temperature=1.0, repetition_penalty=1.2, seed=500 + i)
        elif i % 5 == 1:
            grammar = StructuredOutput("regex", "(ab|cd|ef){2,6}(hello world ){2}[a-z]{1,8}")
            params = SamplingParams(max_tokens=40, temperature=0.8, seed=500 + i, structured=grammar, logprobs=True)
        jobs.append((phrase * 6, params))
    accepted_before = spec_engine.drafter.num_accepted_tokens
    plain = _serve(plain_engine, jobs)
    spec = _serve(spec_engine, jobs)
    _assert_same(plain, spec)
    assert spec_engine.drafter.num_accepted_tokens > accepted_before  # sampled rows kept guesses too
    assert _serve(spec_engine, jobs) == spec


def test_a_grammars_forced_tokens_are_guessed_and_kept(plain_engine, spec_engine):
    jobs = [
        ([20 + i, 30, 40], SamplingParams(max_tokens=60, temperature=0.0, structured=StructuredOutput("regex", pat)))
        for i, pat in enumerate(["(hello world ){3}done", "abcdefghij[0-9]{2}klmnop", '\\{"key":"(yes|no)"\\}'] * 3)
    ]
    accepted_before = spec_engine.drafter.num_accepted_tokens
    steps = plain_engine.num_steps, spec_engine.num_steps
    plain = _serve(plain_engine, jobs)
    spec = _serve(spec_engine, jobs)
    _assert_same(plain, spec)
    assert spec_engine.drafter.num_accepted_tokens - accepted_before >= 9 * 5
    assert all(out["finish"] == "stop" for out in spec.values())
    assert spec_engine.num_steps - steps[1] < (plain_engine.num_steps - steps[0]) * 0.6


def test_a_failed_step_that_carried_guesses_is_recomputed_exactly(plain_engine, spec_engine, monkeypatch):
    """A step with guesses that fails is contained as any other
    (``jaxserve.engine.containment``): its requests are recomputed from the
    tokens delivered, and every output is the one without guesses."""
    jobs = _jobs(24, seed=21)
    plain = _serve(plain_engine, jobs)
    real = spec_engine.runner.execute
    launched: list[int] = []

    def execute(work, *args, **kwargs):
        launched.append(1)
        if len(launched) > 8 and not getattr(execute, "failed", False) and any(w.draft_rows for w in work):
            execute.failed = True  # type: ignore[attr-defined]
            raise RuntimeError("injected fault in a step with guesses")
        return real(work, *args, **kwargs)

    monkeypatch.setattr(spec_engine.runner, "execute", execute)
    failed0 = spec_engine.containment.num_failed_steps
    spec = _serve(spec_engine, jobs)
    assert getattr(execute, "failed", False) and spec_engine.containment.num_failed_steps == failed0 + 1
    _assert_same(plain, spec)


def test_no_compilation_while_serving_with_guesses(checkpoint):
    """Guesses make steps of more tokens than sequences and more sampled
    rows than sequences: every such shape is among the compiled buckets
    (the runner calls the compiled executables, so a missing one raises).
    One sequence alone (the 1-, 2- and 4-token programs), a full batch,
    greedy steps taking their tokens from the forward program and steps
    sampling in the sampling program, with prompts arriving meanwhile."""
    engine = _engine(checkpoint, 7, max_num_seqs=6, max_num_batched_tokens=64, kv_cache_memory=None)
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda name, *_a, **_k: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
    jobs = _jobs(60, seed=9)
    _serve(engine, jobs[:1], stagger=1)  # one sequence alone
    _serve(engine, jobs, stagger=3)
    assert compiles == []
    assert engine.drafter.num_accepted_tokens > 0
    sizes = set(engine.runner.buckets.tokens)
    assert {1, 2, 4} <= sizes  # one sequence verifying one or three guesses


def test_the_switch_off_builds_the_engine_without_guesses(checkpoint):
    engine = Engine(EngineArgs(model=str(checkpoint), max_num_seqs=4, max_model_len=128, num_speculative_tokens=0))
    assert engine.drafter is None and engine.scheduler.drafter is None
    assert engine.runner.max_logits_rows == 4 and engine.runner.buckets.seqs == (1, 2, 4)
    with pytest.raises(ValueError, match="speculative_method"):
        EngineArgs(speculative_method="eagle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineArgs(prompt_lookup_min=5, prompt_lookup_max=2)


def test_async_scheduling_overlaps_steps_nothing_is_guessed_for(checkpoint):
    """With async scheduling, steps of rows that will not be guessed for
    (here: the job turns speculation off) are overlapped as before; a row
    in a copying run is planned after its tokens are known, and guessed
    for."""
    engine = _engine(checkpoint, 4, async_scheduling=True, kv_cache_memory=None)
    plain_engine = _engine(checkpoint, 0, async_scheduling=True, kv_cache_memory=None)
    rng = np.random.default_rng(3)
    off = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, num_speculative_tokens=0)
    first = [(rng.integers(10, 500, size=30).tolist(), off)]
    _assert_same(_serve(plain_engine, first), _serve(engine, first))
    assert engine.num_overlapped_steps > 0 and engine.drafter.num_draft_tokens == 0
    repeat = [
        (rng.integers(10, 500, size=5).tolist() * 8, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    ]
    _assert_same(_serve(plain_engine, repeat), _serve(engine, repeat))
    assert engine.drafter.num_accepted_tokens > 0


# ---------------------------------------------------------------- the switches on the wire and the CLI


def test_a_job_turns_speculation_off_or_lowers_it_on_the_wire():
    import orjson

    from jaxserve.request_error import RequestError
    from jaxserve.wire import JobProperties, parse_job

    def parse(**body):
        return parse_job(orjson.dumps({"prompt": "x", **body}), JobProperties(message_id="k"))

    plain = parse()
    assert plain.params.num_speculative_tokens is None
    assert parse(num_speculative_tokens=0).params.num_speculative_tokens == 0
    assert parse(num_speculative_tokens=3).params.num_speculative_tokens == 3
    # it changes the speed, not the result: the same job for the idempotency store
    assert parse(num_speculative_tokens=0).fingerprint == plain.fingerprint
    for bad in (-1, 65, 2.0, True, "3"):
        with pytest.raises(RequestError) as err:
            parse(num_speculative_tokens=bad)
        assert err.value.code == "invalid_request" and "num_speculative_tokens" in err.value.message


def test_the_worker_and_the_offline_commands_take_the_speculative_flags():
    from click.testing import CliRunner

    from jaxserve.cli.bench import offline as bench_offline
    from jaxserve.cli.generate import generate
    from jaxserve.cli.worker_command import worker
    from jaxserve.engine.args import profile_values

    for command in (worker, generate, bench_offline):
        options = {p.name: p for p in command.params}
        assert {"num_speculative_tokens", "speculative_method"} <= options.keys(), command.name
    serve = profile_values("serve")
    assert serve["num_speculative_tokens"] == 4 and serve["speculative_method"] == "ngram"
    out = CliRunner().invoke(worker, ["--help"])
    assert "--num-speculative-tokens" in out.output and "--speculative-method" in out.output
