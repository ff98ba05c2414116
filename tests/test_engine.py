"""The engine end to end: exactness under continuous batching, no
compilation while serving, seeded sampling independent of the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jax import monitoring

from engine_fixtures import build_engine_checkpoint
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_engine_checkpoint(tmp_path_factory.mktemp("engine-ckpt"))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 500, size=40).tolist()  # a 40-token common prefix (2.5 blocks)
    prompts = [rng.integers(10, 500, size=n).tolist() for n in (3, 17, 33, 70, 9, 51)]
    prompts += [shared + rng.integers(10, 500, size=n).tolist() for n in (5, 12, 30)]
    prompts.append(list(shared))
    return prompts


def _run(engine: Engine, prompts, params_for, stagger: int = 0) -> dict[str, list[int]]:
    """Feed prompts (``stagger`` steps apart) and collect each completion."""
    done: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or step % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for i, prompt in batch:
                engine.add_request(f"r{i}", prompt, params_for(i))
            pending = pending[len(batch) :]
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.token_ids
        step += 1
    return done


def _greedy(_i=0):
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(checkpoint):
    """Each prompt run by itself on a roomy engine."""
    engine = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=4,
            max_num_batched_tokens=128,
            max_model_len=256,
            enable_prefix_caching=False,
        )
    )
    engine.warmup()
    results = {}
    for i, prompt in enumerate(_prompts()):
        results.update({f"r{i}": _run(engine, [prompt], _greedy)["r0"]})
    return results


def test_batched_chunked_prefix_cached_preempted_equals_alone(checkpoint, alone):
    # 15 usable blocks of 16 tokens for 10 requests of up to 90 tokens: the
    # scheduler must preempt; a 16-token budget forces chunked prefill; the
    # shared 40-token prefix hits the prefix cache.
    engine = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=8,
            max_num_batched_tokens=16,
            max_model_len=128,
            block_size=16,
            kv_cache_memory=16 * 8192,
            enable_prefix_caching=True,
        )
    )
    assert engine.num_blocks == 16
    engine.warmup()
    got = _run(engine, _prompts(), _greedy)
    stats = engine.scheduler.stats()
    assert stats.num_preemptions > 0, "the test must exercise preemption"
    assert stats.prefix_cache_hits > 0, "the test must exercise prefix-cache hits"
    assert got == alone
    assert engine.allocator.num_used_blocks == 0  # everything returned


def test_greedy_matches_transformers(checkpoint, alone):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    for i, prompt in enumerate(_prompts()):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out[0, len(prompt) :].tolist() == alone[f"r{i}"], f"prompt {i}"


def test_no_compilation_while_serving(checkpoint):
    engine = Engine(EngineArgs(model=str(checkpoint), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128))
    engine.warmup()
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda name, *_a, **_k: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, size=int(n)).tolist() for n in rng.integers(1, 90, size=12)]

    def varied(i):
        kinds = [
            SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=0.0),
            SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=i),
            SamplingParams(
                max_tokens=6,
                temperature=1.0,
                min_p=0.1,
                repetition_penalty=1.2,
                frequency_penalty=0.5,
                presence_penalty=0.3,
                seed=i,
            ),
            SamplingParams(max_tokens=10, temperature=0.0, stop=("a",), logprobs=True),
        ]
        return kinds[i % len(kinds)]

    _run(engine, prompts, varied, stagger=3)
    assert engine.num_steps > 30
    assert compiles == []


def test_seeded_sampling_independent_of_batch(checkpoint):
    engine = Engine(EngineArgs(model=str(checkpoint), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128))
    engine.warmup()
    prompts = _prompts()[:4]

    def sampled(i):
        return SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True)

    together = _run(engine, prompts, sampled)
    for i, prompt in enumerate(prompts):
        alone = _run(engine, [prompt], lambda _j, i=i: sampled(i))["r0"]
        assert together[f"r{i}"] == alone


def test_admission_errors_name_the_problem(checkpoint):
    engine = Engine(EngineArgs(model=str(checkpoint), max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64))
    with pytest.raises(RequestError) as err:
        engine.add_request("long", list(range(10, 70)), SamplingParams(max_tokens=10))
    assert err.value.code == "context_length_exceeded" and "64" in err.value.message
    with pytest.raises(RequestError) as err:
        engine.add_request("neg", [1, 2], SamplingParams(max_tokens=-1))
    assert err.value.code == "invalid_request" and "max_tokens" in err.value.message
    with pytest.raises(RequestError) as err:
        engine.add_request("oov", [1, 10_000], SamplingParams(max_tokens=2))
    assert err.value.code == "invalid_request" and "10000" in err.value.message


def test_abort_frees_blocks_and_stop_strings_end_requests(checkpoint):
    engine = Engine(EngineArgs(model=str(checkpoint), max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128))
    engine.warmup()
    engine.add_request("a", list(range(10, 50)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.allocator.num_used_blocks > 0
    assert engine.abort("a") is True
    assert engine.allocator.num_used_blocks == 0
    # The step already in flight is collected, and says nothing of "a".
    assert [o for o in engine.step() if o.request_id == "a"] == []
    assert not engine.has_unfinished()
    # A stop string taken from the greedy output itself must end it there.
    engine.add_request("b", "hello there", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    full = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                full = out
    assert full is not None and len(full.text) > 4
    stop = full.text[2:4]
    engine.add_request(
        "c", "hello there", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,))
    )
    streamed, final = "", None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.new_text
            if out.finished:
                final = out
    assert final.finish_reason == "stop"
    assert final.text == full.text[: full.text.index(stop)]
    assert streamed == final.text


def test_greedy_logprobs_match_the_full_sampler(checkpoint):
    """An all-greedy step runs the lean greedy program (with log-probabilities
    only when a row asks for them); its log-probabilities equal those of the
    full sampler, which a sampled neighbour in the batch forces."""
    engine = Engine(EngineArgs(model=str(checkpoint), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128))
    engine.warmup()
    prompt = _prompts()[3]
    wants = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)

    def run(requests):
        for rid, params in requests:
            engine.add_request(rid, prompt, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return done

    greedy_only = run([("a", wants), ("b", plain)])
    mixed = run([("a", wants), ("c", sampled)])
    assert greedy_only["b"].logprobs is None
    assert greedy_only["a"].token_ids == mixed["a"].token_ids
    lean, full = np.asarray(greedy_only["a"].logprobs), np.asarray(mixed["a"].logprobs)
    assert lean.shape == (8,) and np.all(lean < 0)
    np.testing.assert_allclose(lean, full, rtol=1e-4, atol=1e-5)


def test_block_major_decode_steps_equal_alone(checkpoint, alone):
    """Four sequences decoding together fill a cache sized for them: decode
    steps run block-major attention (every cache block against its owner's
    query; the pure-JAX kernel's path, so asked for by name: the CPU's
    default is the C++ kernel), and every output equals the request run alone.
    Without speculative decoding: block-major steps take one token per
    sequence, and guesses make more."""
    engine = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=4,
            max_num_batched_tokens=128,
            max_model_len=128,
            block_size=16,
            enable_prefix_caching=False,
            attention_backend="reference",
            num_speculative_tokens=0,
        )
    )
    engine.warmup()
    picked = [0, 3, 5, 9]  # 3, 70, 51 and 40 prompt tokens
    prompts = [_prompts()[i] for i in picked]
    got = _run(engine, prompts, _greedy)
    assert engine.runner.plans_block_major and engine.runner.num_block_major_steps > 5
    assert [got[f"r{j}"] for j in range(len(picked))] == [alone[f"r{i}"] for i in picked]


def test_async_scheduling_equals_sync(checkpoint):
    """Launching step N+1 before fetching step N (tokens fed on the device)
    changes nothing the caller sees: same tokens, texts and finish reasons,
    with stop ids (the request computes one extra, dropped token), stop
    strings, max_tokens, a sampled neighbour and prefix-cache hits; and the
    blocks all come back."""
    prompts = _prompts()
    stop_id = alone_first = None

    def params(i):
        if i % 4 == 1:
            return SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=(stop_id,))
        if i % 4 == 2:
            return SamplingParams(max_tokens=int(5 + i), temperature=0.0, ignore_eos=True)
        if i == 7:
            return SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    results = {}
    for mode in (False, True):
        engine = Engine(
            EngineArgs(
                model=str(checkpoint),
                max_num_seqs=4,
                max_num_batched_tokens=64,
                max_model_len=128,
                block_size=16,
                async_scheduling=mode,
            )
        )
        engine.warmup()
        if stop_id is None:  # a token request 1 really produces mid-stream
            alone_first = _run(engine, [prompts[1]], lambda _i: SamplingParams(max_tokens=9, temperature=0.0))
            stop_id = alone_first["r0"][4]
        done = {}
        pending = list(enumerate(prompts))
        step = 0
        while pending or engine.has_unfinished():
            if pending and step % 2 == 0:
                i, prompt = pending.pop(0)
                engine.add_request(f"r{i}", prompt, params(i))
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.token_ids, out.text, out.finish_reason)
            step += 1
        assert engine.allocator.num_used_blocks == 0
        results[mode] = (done, engine.num_overlapped_steps)
    (sync, n_sync), (overlapped, n_async) = results[False], results[True]
    assert n_sync == 0 and n_async > 10
    assert overlapped == sync
    assert sync["r1"][2] == "stop" and len(sync["r1"][0]) < 9


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_admitted_by_before_plan_joins_that_plan(checkpoint, async_scheduling):
    """``step()`` collects the step in flight and plans the next inside one
    call; a request the ``before_plan`` hook adds (the worker's thread admits
    arrivals there) is in the step planned by that very call, so its first
    token comes back from the next call, not the one after."""
    engine = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=2,
            max_num_batched_tokens=32,
            max_model_len=64,
            block_size=16,
            async_scheduling=async_scheduling,
        )
    )
    engine.warmup()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("r0", [11, 12, 13, 14], params)
    assert engine.step() == []  # r0's prefill launched
    calls = []

    def arrive():
        calls.append(len(calls))
        if len(calls) == 1:
            engine.add_request("r1", [21, 22, 23], params)

    engine.before_plan = arrive
    second = {o.request_id: len(o.new_token_ids) for o in engine.step()}
    assert second == {"r0": 1} and calls == [0]
    third = {o.request_id: len(o.new_token_ids) for o in engine.step()}
    assert third == {"r0": 1, "r1": 1} and calls == [0, 1]


def test_interactive_outputs_are_handed_over_before_the_next_plan(checkpoint):
    """With ``on_urgent_outputs`` set, an interactive request's tokens leave
    the engine as soon as its step is collected, before the next step is
    planned and launched, and only there (never in ``step()``'s return); the
    step that starts an interactive prompt is collected in the call that
    launched it;
    batch outputs and an interactive scoring job's (a group) still come back
    from ``step()``. What each request receives is the same as without the
    hook: tokens, texts, a stop string's cut and finish reasons."""
    from jaxserve.engine.types import RequestClass

    prompts = _prompts()
    interactive = {"r1", "r4", "r6"}

    def params(i):
        if i == 4:
            return SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop_text,) if stop_text else ()
            )
        return SamplingParams(max_tokens=int(6 + i), temperature=0.0, ignore_eos=True)

    def run(hooked: bool):
        engine = Engine(
            EngineArgs(
                model=str(checkpoint),
                max_num_seqs=4,
                max_num_batched_tokens=64,
                max_model_len=128,
                block_size=16,
                async_scheduling=False,
            )
        )
        engine.warmup()
        events: list[tuple] = []
        got: dict[str, list] = {}
        added_at: dict[str, int] = {}
        first_handed: dict[str, int] = {}
        if hooked:
            engine.before_plan = lambda: events.append(("plan",))
            for part in ("collect", "launch"):  # the step parts the modes call, recorded in order
                original = getattr(engine, part)
                setattr(engine, part, lambda *a, _f=original, _p=part, **k: (events.append((_p,)), _f(*a, **k))[1])

            def urgent(outs):
                since_collect = events[len(events) - 1 - events[::-1].index(("collect",)) :]
                assert ("launch",) not in since_collect  # the next step is not launched yet
                events.append(("urgent", sorted(o.request_id for o in outs)))
                for o in outs:
                    first_handed.setdefault(o.request_id, step)
                for o in outs:
                    got.setdefault(o.request_id, []).append(o)

            engine.on_urgent_outputs = urgent
        engine.add_score_request("s0", prompts[2], [[40], [41, 42]], request_class=RequestClass.INTERACTIVE)
        pending = list(enumerate(prompts[:7]))
        step = 0
        while pending or engine.has_unfinished():
            if pending and step % 2 == 0:
                i, prompt = pending.pop(0)
                rc = RequestClass.INTERACTIVE if f"r{i}" in interactive else RequestClass.BATCH
                engine.add_request(f"r{i}", prompt, params(i), request_class=rc)
                added_at[f"r{i}"] = step
            events.append(("step",))
            for o in engine.step():
                assert not (hooked and o.request_id in interactive), o.request_id
                got.setdefault(o.request_id, []).append(o)
            step += 1
        seen = {
            rid: (
                [t for o in outs for t in o.new_token_ids],
                "".join(o.new_text for o in outs),
                outs[-1].finish_reason,
                outs[-1].label_logprobs is not None,
            )
            for rid, outs in got.items()
        }
        return seen, events, {rid: (added_at[rid], first_handed[rid]) for rid in first_handed}

    stop_text = None
    plain, _, _ = run(False)
    stop_text = plain["r4"][1][3:6]  # text request 4 produces mid-stream
    plain, _, _ = run(False)
    hooked, events, firsts = run(True)
    assert hooked == plain
    # An interactive prompt's own step is waited for at once: its first token
    # leaves the engine in the call that admitted it.
    assert sorted(firsts) == sorted(interactive) and all(a == b for a, b in firsts.values()), firsts
    assert plain["r4"][2] == "stop" and plain["s0"][3]
    urgent_calls = [e for e in events if e[0] == "urgent"]
    assert urgent_calls and all(set(e[1]) <= interactive for e in urgent_calls)
    for i, e in enumerate(events):  # each hand-over is followed by that call's plan
        if e[0] == "urgent":
            assert events[i + 1] == ("plan",), events[i - 2 : i + 3]


def test_batch_prompts_capped_beside_interactive_work_equal_alone(checkpoint, alone):
    """``interactive_batch_prefill_tokens``: while interactive requests run,
    batch prompts advance in chunks of at most the cap (and the outputs of
    both classes stay exactly what each request gets alone)."""
    from jaxserve.engine.types import RequestClass

    engine = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=6,
            max_num_batched_tokens=128,
            max_model_len=128,
            block_size=16,
            interactive_batch_prefill_tokens=5,
            enable_prefix_caching=False,
        )
    )
    engine.warmup()
    prompts = _prompts()
    interactive = {0, 4}
    for i in sorted(interactive):
        engine.add_request(f"r{i}", prompts[i], _greedy(), request_class=RequestClass.INTERACTIVE)
    plans = []
    real = engine.scheduler.schedule

    def spy():
        plans.append(real())
        return plans[-1]

    engine.scheduler.schedule = spy
    got: dict[str, list[int]] = {}
    pending = [i for i in range(len(prompts)) if i not in interactive]
    while pending or engine.has_unfinished():
        if pending:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], _greedy(), request_class=RequestClass.BATCH)
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                got[out.request_id] = out.token_ids
    assert got == {f"r{i}": alone[f"r{i}"] for i in range(len(prompts))}
    batch_prompt_tokens = [  # (a decode's guessed tokens, speculative decoding, are no prompt tokens)
        sum(
            s.num_scheduled_tokens - len(s.draft_token_ids)
            for s in plan.scheduled
            if int(s.request_id[1:]) not in interactive and s.num_scheduled_tokens - len(s.draft_token_ids) > 1
        )
        for plan in plans
        if any(int(s.request_id[1:]) in interactive for s in plan.scheduled)
    ]
    assert max(batch_prompt_tokens) == 5, batch_prompt_tokens  # the cap held and was reached
