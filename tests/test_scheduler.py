"""Scheduler: budgets, chunked prefill, classes, policies, reserve, preemption,
abort and prefix caching, with a fake model feeding sampled tokens back."""

from __future__ import annotations

import pytest

from jaxserve.engine.config import SchedulerConfig
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.types import RequestClass
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams

BS = 4


def make(**overrides) -> Scheduler:
    cfg = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=BS,
        num_blocks=64,
        enable_prefix_caching=False,
        # the mixed step: most tests here pin rules within one step of both
        # classes; the tests of the interactive prompt's own step turn it on
        interactive_prefill_alone=False,
    )
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def req(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    *,
    start: int = 0,
    cls: str = "interactive",
    priority: int = 0,
    arrival: float = 0.0,
    salt: object = None,
) -> Request:
    return Request(
        rid,
        list(range(start, start + prompt_len)),
        SamplingParams(max_tokens=max_tokens),
        request_class=cls,
        priority=priority,
        arrival_time=arrival,
        cache_salt=salt,
    )


def fake_token(r: Request) -> int:
    """Deterministic 'model': the k-th generated token of any request is 1000 + k."""
    return 1000 + r.num_output_tokens


def step(s: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    out = s.schedule()
    sampled = {x.request_id: fake_token(s.get_request(x.request_id)) for x in out.scheduled if x.sample}
    return out, s.update_from_output(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(x.request_id, x.start_position, x.num_scheduled_tokens, x.sample) for x in out.scheduled]


def test_token_budget_and_seq_cap():
    s = make(max_num_seqs=2, max_num_batched_tokens=16)
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, 10, max_tokens=2, arrival=i))
    out, _ = step(s)
    assert plan(out) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert out.total_num_scheduled_tokens == 16
    assert s.num_running == 2 and s.num_waiting == 1
    out, fin = step(s)
    # a decodes first; b finishes its prompt; c waits for a free sequence slot.
    assert plan(out) == [("a", 10, 1, True), ("b", 6, 4, True)]
    assert fin == ["a"]
    out, fin = step(s)
    assert plan(out) == [("b", 10, 1, True), ("c", 0, 10, True)]
    assert out.finished_req_ids == ["a"]
    assert fin == ["b"]
    # Block tables cover exactly the computed-plus-scheduled tokens.
    c = out.get("c")
    assert c.block_ids == [1, 2, 3] and c.token_ids == list(range(10)) and c.is_new


def test_chunked_prefill_never_stalls_a_decode():
    s = make(max_num_batched_tokens=8)
    s.add_request(req("d", 3, max_tokens=10))
    out, _ = step(s)
    assert plan(out) == [("d", 0, 3, True)]
    s.add_request(req("long", 40, max_tokens=1, arrival=1))
    chunks = []
    while True:
        out, fin = step(s)
        d = out.get("d")
        assert d is not None and d.num_scheduled_tokens == 1 and d.sample, "the decode got no token this step"
        assert out.total_num_scheduled_tokens <= 8
        long = out.get("long")
        chunks.append((long.num_scheduled_tokens, long.sample))
        if "long" in fin:
            break
    assert chunks == [(7, False)] * 5 + [(5, True)]
    assert s.get_request("d").num_output_tokens == 7


def test_long_prefill_threshold_caps_a_chunk():
    s = make(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    s.add_request(req("p", 20, max_tokens=1))
    s.add_request(req("q", 5, max_tokens=1, arrival=1))
    out, _ = step(s)
    assert plan(out) == [("p", 0, 6, False), ("q", 0, 5, True)]
    out, _ = step(s)
    assert plan(out) == [("p", 6, 6, False)]


def test_max_model_len_is_enforced_at_admission_with_numbers():
    s = make(max_model_len=32)
    with pytest.raises(RequestError) as e:
        s.add_request(req("x", 30, max_tokens=5))
    assert e.value.code == "context_length_exceeded" and not e.value.retryable
    assert "32" in e.value.message and "35" in e.value.message and "30" in e.value.message and "5" in e.value.message
    with pytest.raises(RequestError) as e:
        s.add_request(req("y", 32, max_tokens=1))
    assert e.value.code == "context_length_exceeded"
    assert "32 tokens" in e.value.message
    s.add_request(req("ok", 30, max_tokens=2))  # exactly max_model_len is fine
    assert not s.get_request("x") and s.num_waiting == 1


def test_duplicate_id_and_overload_are_refused():
    s = make(max_num_waiting=2)
    s.add_request(req("a", 4))
    with pytest.raises(RequestError) as e:
        s.add_request(req("a", 4))
    assert e.value.code == "invalid_request" and "'a'" in e.value.message
    s.add_request(req("b", 4))
    with pytest.raises(RequestError) as e:
        s.add_request(req("c", 4))
    assert e.value.code == "overloaded" and e.value.retryable


def test_interactive_ahead_of_batch():
    s = make(max_num_seqs=1, max_num_batched_tokens=8)
    s.add_request(req("batch", 4, max_tokens=1, cls="batch", arrival=0))
    s.add_request(req("inter", 4, max_tokens=1, cls="interactive", arrival=5))
    order = []
    while s.has_unfinished():
        out, _ = step(s)
        order += [x.request_id for x in out.scheduled]
    assert order == ["inter", "batch"]


def test_interactive_reserve_of_sequences():
    s = make(max_num_seqs=3, max_num_batched_tokens=64, interactive_reserved_seqs=1)
    for i in range(3):
        s.add_request(req(f"b{i}", 4, max_tokens=8, cls="batch", arrival=i))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["b0", "b1"]
    s.add_request(req("i", 4, max_tokens=8, arrival=10))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["b0", "b1", "i"]
    assert s.num_running == 3 and [r.request_id for r in s.waiting_requests(RequestClass.BATCH)] == ["b2"]


def test_interactive_reserve_of_blocks():
    # 10 usable blocks of 4 tokens, 4 kept for interactive traffic.
    s = make(num_blocks=11, max_model_len=24, interactive_reserved_blocks=4)
    s.add_request(req("b1", 16, max_tokens=8, cls="batch"))
    s.add_request(req("b2", 12, max_tokens=8, cls="batch", arrival=1))
    out, _ = step(s)
    # b1 takes 4 blocks (6 left); b2 would need 3 and leave 3 < 4: it waits.
    assert plan(out) == [("b1", 0, 16, True)]
    assert s.allocator.num_free_blocks == 6
    s.add_request(req("i", 12, max_tokens=8, arrival=2))
    out, _ = step(s)
    assert plan(out) == [("b1", 16, 1, True), ("i", 0, 12, True)]
    assert s.allocator.num_free_blocks == 2  # b1 took a 5th block, i took 3
    # b1 fills its 5th block; then it may not grow into the reserve: it
    # preempts itself while interactive i keeps going.
    events = []
    for _ in range(4):
        out, _ = step(s)
        events.append((tuple(x.request_id for x in out.scheduled), tuple(out.preempted_req_ids)))
    # (Plans list interactive requests first.) i takes its 4th block in the
    # first of these steps, leaving 1 free; b1 needs its 6th block in the
    # last one and, with 1 block free but 4 reserved, preempts itself.
    assert events == [
        (("i", "b1"), ()),
        (("i", "b1"), ()),
        (("i", "b1"), ()),
        (("i",), ("b1",)),
    ]
    assert s.allocator.num_free_blocks == 1 + 5
    assert s.get_request("b1").status == RequestStatus.PREEMPTED
    assert s.get_request("b1").block_ids == []
    assert [r.request_id for r in s.waiting_requests("batch")] == ["b1", "b2"]


@pytest.mark.parametrize(
    "policy, expected",
    [("fcfs", ["p5", "p1", "p3"]), ("priority", ["p1", "p3", "p5"])],
)
def test_fcfs_vs_priority_admission_order(policy, expected):
    s = make(policy=policy, max_num_seqs=1, max_num_batched_tokens=8)
    s.add_request(req("p5", 4, max_tokens=1, priority=5, arrival=0))
    s.add_request(req("p1", 4, max_tokens=1, priority=1, arrival=1))
    s.add_request(req("p3", 4, max_tokens=1, priority=3, arrival=2))
    order = []
    while s.has_unfinished():
        out, _ = step(s)
        order += [x.request_id for x in out.scheduled]
    assert order == expected


def run_two_until_preemption(s: Scheduler) -> SchedulerOutput:
    """Steps until a plan preempts something; 6 usable blocks, two 8-token prompts."""
    for _ in range(10):
        out, _ = step(s)
        if out.preempted_req_ids:
            return out
    raise AssertionError("no preemption happened")


def test_preemption_takes_the_newest_frees_its_blocks_and_it_is_recomputed():
    s = make(num_blocks=7, max_model_len=24)
    s.add_request(req("old", 8, max_tokens=8, arrival=0))
    s.add_request(req("new", 8, max_tokens=8, arrival=1))
    out = run_two_until_preemption(s)
    # Steps 1-5 fill all 6 blocks; at step 6 'old' needs a 4th block.
    assert out.step == 6
    assert out.preempted_req_ids == ["new"]
    assert plan(out) == [("old", 12, 1, True)]
    new = s.get_request("new")
    assert new.status == RequestStatus.PREEMPTED and new.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.block_ids == []
    assert new.output_token_ids == [1000, 1001, 1002, 1003, 1004]  # generated tokens are kept
    assert s.allocator.num_free_blocks == 2  # its 3 blocks came back, 'old' took one
    assert s.stats().num_preemptions == 1

    recomputed = None
    while s.has_unfinished():
        out, _ = step(s)
        x = out.get("new")
        if x is not None and x.is_new:
            recomputed = x
    # Once 'old' finished, 'new' came back from scratch: prompt + 5 outputs in one go.
    assert recomputed is not None
    assert (recomputed.start_position, recomputed.num_scheduled_tokens, recomputed.sample) == (0, 13, True)
    assert recomputed.token_ids == list(range(8)) + [1000, 1001, 1002, 1003, 1004]
    assert new.status == RequestStatus.FINISHED_LENGTH
    assert new.num_tokens == 16 and new.output_token_ids == [1000 + k for k in range(8)]
    assert s.allocator.num_free_blocks == 6


def test_preemption_takes_batch_before_an_older_interactive_and_undoes_its_plan():
    s = make(num_blocks=7, max_model_len=24)
    s.add_request(req("b", 8, max_tokens=8, cls="batch", arrival=0))
    s.add_request(req("i", 8, max_tokens=8, cls="interactive", arrival=1))
    out = run_two_until_preemption(s)
    assert out.preempted_req_ids == ["b"]
    assert plan(out) == [("i", 12, 1, True)]
    assert out.total_num_scheduled_tokens == 1


def test_preemption_of_a_request_already_planned_this_step_returns_its_tokens():
    # 'b' (batch) decodes and is planned first; interactive 'i' then needs
    # blocks for its next prompt chunk and preempts it.
    s = make(num_blocks=7, max_model_len=24, max_num_batched_tokens=8)
    s.add_request(req("b", 7, max_tokens=8, cls="batch", arrival=0))
    out, _ = step(s)
    assert plan(out) == [("b", 0, 7, True)]
    s.add_request(req("i", 20, max_tokens=2, arrival=1))
    out, _ = step(s)
    assert plan(out) == [("b", 7, 1, True), ("i", 0, 7, False)]
    assert s.allocator.num_free_blocks == 2
    # b's decode takes a 3rd block (1 left); i's next chunk needs 2 more, so
    # b, planned earlier in this very step, is preempted and unplanned.
    out, _ = step(s)
    assert out.preempted_req_ids == ["b"]
    assert plan(out) == [("i", 7, 7, False)]
    assert out.total_num_scheduled_tokens == 7
    assert s.get_request("b").block_ids == [] and s.allocator.num_free_blocks == 2
    # Next step i finishes its prompt and b comes back from scratch in what
    # is left of the budget (its prompt plus the 2 tokens it had generated).
    out, _ = step(s)
    assert plan(out) == [("i", 14, 6, True), ("b", 0, 2, False)]
    assert out.get("b").is_new


def test_priority_policy_preempts_the_largest_priority_value():
    s = make(policy="priority", num_blocks=7, max_model_len=24)
    s.add_request(req("low", 8, max_tokens=8, priority=9, arrival=0))
    s.add_request(req("high", 8, max_tokens=8, priority=1, arrival=1))
    out = run_two_until_preemption(s)
    assert out.preempted_req_ids == ["low"]
    assert [x.request_id for x in out.scheduled] == ["high"]


def test_lowest_ranked_request_preempts_itself_not_a_higher_class():
    # Interactive 'i' holds 3 blocks; batch 'b' needs a 4th while none is free.
    s = make(num_blocks=7, max_model_len=24)
    s.add_request(req("i", 10, max_tokens=8, arrival=1))
    s.add_request(req("b", 11, max_tokens=8, cls="batch", arrival=0))
    out, _ = step(s)
    assert plan(out) == [("i", 0, 10, True), ("b", 0, 11, True)]
    out, _ = step(s)
    assert out.preempted_req_ids == []
    out, _ = step(s)
    assert out.preempted_req_ids == ["b"]
    assert plan(out) == [("i", 11, 1, True)]
    assert s.get_request("i").status == RequestStatus.RUNNING


def test_abort_frees_blocks_at_once():
    s = make()
    s.add_request(req("run", 10, max_tokens=8))
    s.add_request(req("wait", 10, max_tokens=8, cls="batch", arrival=1))
    assert s.abort("nope") is False
    out, _ = step(s)
    assert s.allocator.num_free_blocks == 63 - 6
    assert s.abort("run") is True
    assert s.allocator.num_free_blocks == 63 - 3
    assert s.abort("run") is False
    assert s.num_running == 1
    # A waiting request can be aborted too.
    s.add_request(req("queued", 4, max_tokens=1, cls="batch", arrival=2))
    assert s.abort("queued") is True
    assert s.num_waiting == 0
    out, _ = step(s)
    assert plan(out) == [("wait", 10, 1, True)]
    assert out.finished_req_ids == ["run", "queued"] and out.aborted_req_ids == ["run", "queued"]


def test_abort_between_plan_and_results_is_skipped():
    s = make()
    s.add_request(req("a", 4, max_tokens=3))
    out = s.schedule()
    s.abort("a")
    assert s.update_from_output(out, {"a": 1}) == []
    assert not s.has_unfinished() and s.allocator.num_free_blocks == 63


def test_engine_decided_stop_frees_and_reports():
    s = make()
    s.add_request(req("a", 4, max_tokens=10))
    step(s)
    assert s.finish_request("a", RequestStatus.FINISHED_STOPPED) is True
    assert s.allocator.num_free_blocks == 63
    out = s.schedule()
    assert out.is_empty and out.finished_req_ids == ["a"] and out.aborted_req_ids == []
    with pytest.raises(ValueError):
        s.finish_request("a", RequestStatus.RUNNING)


def test_update_checks_the_plan():
    s = make()
    s.add_request(req("a", 4, max_tokens=3))
    out = s.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        s.update_from_output(out, {})
    s.update_from_output(out, {"a": 5})
    with pytest.raises(ValueError, match="stale plan"):
        s.update_from_output(out, {"a": 5})


def test_prefix_cache_hit_skips_cached_tokens():
    s = make(enable_prefix_caching=True)
    s.add_request(req("a", 18, max_tokens=2))
    while s.has_unfinished():
        step(s)
    # Same first 16 tokens, then different ones: 4 blocks hit, 3 tokens left.
    b = Request("b", list(range(16)) + [99, 98, 97], SamplingParams(max_tokens=1))
    s.add_request(b)
    out, _ = step(s)
    assert plan(out) == [("b", 16, 3, True)]
    assert out.scheduled[0].block_ids[:4] == [1, 2, 3, 4] and out.scheduled[0].is_new
    assert b.num_cached_tokens == 16
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18 + 19, 16)
    assert s.allocator.prefix_cache_hit_blocks == 4
    # A prompt wholly cached still computes its last block's tokens, to sample.
    s.add_request(Request("c", list(range(16)), SamplingParams(max_tokens=1)))
    out, _ = step(s)
    assert plan(out) == [("c", 12, 4, True)]
    # Another salt (adapter/model): no hit.
    s.add_request(req("d", 18, max_tokens=1, salt="adapter-2"))
    out, _ = step(s)
    assert plan(out) == [("d", 0, 18, True)]


def test_shared_prefix_blocks_are_refcounted_while_both_run():
    s = make(enable_prefix_caching=True)
    s.add_request(req("a", 9, max_tokens=8))
    step(s)
    s.add_request(req("b", 9, max_tokens=8, arrival=1))
    out, _ = step(s)
    a_blocks = out.get("a").block_ids
    b_blocks = out.get("b").block_ids
    assert a_blocks[:2] == b_blocks[:2]
    assert [s.allocator.ref_count(x) for x in a_blocks[:2]] == [2, 2]
    assert plan(out) == [("a", 9, 1, True), ("b", 8, 1, True)]
    s.abort("a")
    assert [s.allocator.ref_count(x) for x in b_blocks[:2]] == [1, 1]


def test_config_validation_messages():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="needs 8 blocks"):
        SchedulerConfig(max_model_len=32, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="interactive_reserved_blocks"):
        SchedulerConfig(max_model_len=32, block_size=4, num_blocks=12, interactive_reserved_blocks=4)
    with pytest.raises(ValueError, match="interactive_reserved_seqs"):
        SchedulerConfig(max_num_seqs=2, interactive_reserved_seqs=2)


def test_stats_track_usage_and_queues():
    s = make(max_num_seqs=1)
    s.add_request(req("a", 8, max_tokens=2))
    s.add_request(req("b", 8, max_tokens=2, cls="batch", arrival=1))
    step(s)
    st = s.stats()
    assert (st.num_running, st.num_waiting, st.num_waiting_batch) == (1, 1, 1)
    assert st.kv_cache_usage == pytest.approx(2 / 63)


@pytest.mark.parametrize(
    "seed, policy, alone, step_tokens",
    [
        (0, "fcfs", True, 0),
        (1, "priority", True, 0),
        (2, "fcfs", False, 0),
        (3, "fcfs", True, 5),
        (4, "priority", False, 7),
    ],
)
def test_random_workload_keeps_invariants_and_kv_contents(seed, policy, alone, step_tokens):
    """A fake paged KV cache records which token sits in each slot; every
    scheduled chunk checks that its context (including prefix-cache hits and
    blocks kept across steps) holds exactly its earlier tokens. The fake model
    samples a function of the whole context, so recomputation after a
    preemption must reproduce the same output."""
    import random

    rng = random.Random(seed)
    cfg = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_model_len=48,
        block_size=BS,
        num_blocks=30,
        policy=policy,
        interactive_reserved_seqs=1,
        interactive_reserved_blocks=3,
        enable_prefix_caching=True,
        long_prefill_token_threshold=10,
        interactive_prefill_alone=alone,
        interactive_batch_prefill_tokens=4 if step_tokens else 0,
        interactive_step_tokens=step_tokens,
    )
    s = Scheduler(cfg, clock=FakeClock())  # once interactive work was seen, the caps stay on
    slots: dict[int, int] = {}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    expected_len: dict[str, int] = {}
    done: dict[str, Request] = {}
    aborted: set[str] = set()

    def model_token(context: list[int]) -> int:
        return (sum(context) * 31 + len(context)) % 50

    n = 0
    for _ in range(400):
        if n < 60 and rng.random() < 0.35:
            prompt = list(rng.choice(prefixes))[: rng.randrange(1, 20)]
            prompt += [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            prompt = prompt[:40] or [1]
            r = Request(
                f"r{n}",
                prompt,
                SamplingParams(max_tokens=rng.randrange(1, 48 - len(prompt) + 1)),
                request_class=rng.choice(["interactive", "batch"]),
                priority=rng.randrange(3),
                arrival_time=float(n),
            )
            s.add_request(r)
            expected_len[r.request_id] = r.num_prompt_tokens + r.max_tokens
            n += 1
        if s.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(s.requests))
            done[rid] = s.requests[rid]
            assert s.abort(rid)
            aborted.add(rid)
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        running_batch = sum(1 for r in s.running if r.request_class == RequestClass.BATCH)
        assert running_batch <= cfg.max_num_seqs - cfg.interactive_reserved_seqs
        sampled = {}
        for x in out.scheduled:
            r = s.requests[x.request_id]
            assert 0 not in x.block_ids
            assert len(x.block_ids) * BS >= x.start_position + x.num_scheduled_tokens
            assert x.token_ids == r.all_token_ids[x.start_position : x.start_position + x.num_scheduled_tokens]
            for pos in range(x.start_position):  # the context already in the cache
                assert slots.get(x.block_ids[pos // BS] * BS + pos % BS) == r.all_token_ids[pos]
            for k, tok in enumerate(x.token_ids):
                pos = x.start_position + k
                slots[x.block_ids[pos // BS] * BS + pos % BS] = tok
            if x.sample:
                sampled[x.request_id] = model_token(r.all_token_ids)
        snapshot = {x.request_id: s.requests[x.request_id] for x in out.scheduled}
        for rid in s.update_from_output(out, sampled):
            done[rid] = snapshot[rid]
        # Reference counts equal the number of block tables holding each block.
        held: dict[int, int] = {}
        for r in s.running:
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        for b in range(1, cfg.num_blocks):
            assert s.allocator.ref_count(b) == held.get(b, 0)
        assert s.allocator.num_free_blocks == cfg.num_blocks - 1 - len(held)
        assert all(not r.block_ids for q in ("interactive", "batch") for r in s.waiting_requests(q))
    while s.has_unfinished():  # drain
        out = s.schedule()
        snapshot = {x.request_id: s.requests[x.request_id] for x in out.scheduled}
        sampled = {x.request_id: model_token(snapshot[x.request_id].all_token_ids) for x in out.scheduled if x.sample}
        for rid in s.update_from_output(out, sampled):
            done[rid] = snapshot[rid]
    assert len(done) == n
    for rid, r in done.items():
        if rid in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            continue
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_tokens == expected_len[rid]
        for i in range(r.num_prompt_tokens, r.num_tokens):
            assert r.all_token_ids[i] == model_token(r.all_token_ids[:i])
    assert s.allocator.num_free_blocks == cfg.num_blocks - 1
    assert s.stats().num_preemptions > 0 and s.stats().prefix_cache_hits > 0


def test_pending_token_is_hashed_only_once_known():
    """A sampled token still on the device enters as a placeholder: the block
    holding it gets no prefix-cache hash until the value is filled in, and
    then the same hash as if it had been known all along."""
    from jaxserve.engine.request import PENDING_TOKEN

    prompt = list(range(10, 17))  # 7 tokens; the 8th (sampled) completes block 1 of 4
    known = Request("known", prompt, SamplingParams(max_tokens=4))
    known.enable_block_hashing(4)
    known.append_output_token(99)
    req = Request("pending", prompt, SamplingParams(max_tokens=4))
    req.enable_block_hashing(4)
    req.append_output_token(PENDING_TOKEN)
    assert req.num_tokens == 8 and req.pending_index == 7
    assert req.block_hashes == known.block_hashes[:1]
    with pytest.raises(ValueError, match="already has a pending token"):
        req.append_output_token(PENDING_TOKEN)
    req.resolve_pending(99)
    assert req.pending_index is None
    assert req.all_token_ids == known.all_token_ids and req.output_token_ids == [99]
    assert req.block_hashes == known.block_hashes and len(req.block_hashes) == 2
    with pytest.raises(ValueError, match="no pending token"):
        req.resolve_pending(5)


# ---------------------------------------------------------------- recovery


def test_a_deadline_stops_applying_at_the_first_output_token():
    r = Request("d", [1, 2, 3], SamplingParams(max_tokens=4), deadline=10.0)
    assert not r.is_expired(9.9) and r.is_expired(10.0)
    r.append_output_token(7)
    assert not r.is_expired(10.0) and not r.is_expired(1e9)
    s = make(num_blocks=7, max_model_len=24)
    s.add_request(req("old", 8, max_tokens=8, arrival=0))
    late = req("new", 8, max_tokens=8, arrival=1)
    late.deadline = 100.0
    s.add_request(late)
    assert s.expired_request_ids(100.0) == ["new"]
    run_two_until_preemption(s)
    assert late.status == RequestStatus.PREEMPTED and late.num_output_tokens == 5
    assert s.expired_request_ids(100.0) == []  # waiting again, but it has produced tokens


def test_reset_for_recompute_keeps_delivered_tokens_only():
    s = make(num_blocks=32, enable_prefix_caching=True)
    a, b = req("a", 6, max_tokens=6, arrival=0), req("b", 5, max_tokens=3, arrival=1)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):
        step(s)
    assert b.status == RequestStatus.FINISHED_LENGTH and s.get_request("b") is None
    assert a.output_token_ids == [1000, 1001, 1002] and len(a.block_ids) == 2
    free_before = s.allocator.num_free_blocks
    s.reset_for_recompute(a, 1)
    assert (a.status, a.num_computed_tokens, a.block_ids, a.output_token_ids) == (
        RequestStatus.PREEMPTED,
        0,
        [],
        [1000],
    )
    assert a.all_token_ids == list(range(6)) + [1000]
    assert len(a.block_hashes) == 1 and s.allocator.num_free_blocks == free_before + 2
    # b finished in the failed step: it is brought back, and no plan reports it finished
    s.reset_for_recompute(b, 2)
    assert b.status == RequestStatus.PREEMPTED and s.get_request("b") is b and b.output_token_ids == [1000, 1001]
    out = s.schedule()
    assert out.finished_req_ids == []
    # both are recomputed from scratch, their shared first block from the
    # prefix cache; each went to the front of the queue (b last, so first)
    assert plan(out) == [("b", 4, 3, True), ("a", 4, 3, True)]
    assert [x.token_ids for x in out.scheduled] == [[4, 1000, 1001], [4, 5, 1000]]
    c = req("c", 3)
    c.append_output_token(9)
    with pytest.raises(ValueError, match="has 1 output tokens; cannot keep 5"):
        c.truncate_output(5)
    with pytest.raises(ValueError, match="cannot be recomputed"):
        s.reset_for_recompute(c, 0)  # not in this scheduler


def test_reset_for_recompute_refuses_an_aborted_request():
    s = make()
    r = req("a", 4)
    s.add_request(r)
    step(s)
    s.abort("a")
    with pytest.raises(ValueError, match="cannot be recomputed"):
        s.reset_for_recompute(r, 0)


def test_schedule_isolated_plans_one_request_and_makes_room_whatever_the_ranks():
    # 8 usable blocks; 'i' (interactive, best ranked) and 'b' (batch) hold
    # 3 blocks each; a batch request isolated alone preempts both to be admitted.
    s = make(num_blocks=9, max_model_len=24, max_num_seqs=2)
    s.add_request(req("i", 12, max_tokens=8, arrival=0))
    s.add_request(req("b", 12, max_tokens=8, cls="batch", arrival=1))
    step(s)
    s.add_request(req("x", 20, max_tokens=3, cls="batch", arrival=2))
    out = s.schedule_isolated("i")  # running: just its decode, nobody else
    assert plan(out) == [("i", 12, 1, True)] and out.preempted_req_ids == []
    s.update_from_output(out, {"i": 1001})
    out = s.schedule_isolated("x")  # waiting: needs a slot and 5 blocks
    assert out.preempted_req_ids == ["b", "i"]  # worst first, until it fits
    assert plan(out) == [("x", 0, 20, True)] and out.get("x").is_new
    assert s.num_running == 1 and s.get_request("i").status == RequestStatus.PREEMPTED
    with pytest.raises(ValueError, match="no unfinished request 'nope'"):
        s.schedule_isolated("nope")


def test_interactive_prefill_goes_before_batch_chunks_in_the_same_step():
    s = make(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=64, interactive_reserved_seqs=0)
    s.add_request(req("b", 40, cls="batch", arrival=0))
    step(s)  # b takes the whole budget with its first chunk
    s.add_request(req("i", 8, cls="interactive", arrival=1))
    out, _ = step(s)
    # the newly arrived interactive prompt is planned first, b gets the rest
    assert plan(out) == [("i", 0, 8, True), ("b", 16, 8, False)]


def test_interactive_takes_a_seat_from_a_batch_chunk():
    s = make(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64, interactive_reserved_seqs=0, max_model_len=128)
    s.add_request(req("b1", 60, max_tokens=8, cls="batch", arrival=0))
    s.add_request(req("b2", 60, max_tokens=8, cls="batch", arrival=1))
    out, _ = step(s)
    assert plan(out) == [("b1", 0, 60, True), ("b2", 0, 4, False)]  # both seats are batch now
    s.add_request(req("i", 4, cls="interactive", arrival=2))
    out, _ = step(s)
    # b1 decodes; the interactive request needs a seat: b2 (a chunk not planned yet) is preempted
    assert plan(out) == [("b1", 60, 1, True), ("i", 0, 4, True)]
    assert out.preempted_req_ids == ["b2"] and s.get_request("b2").status == RequestStatus.PREEMPTED


def test_a_step_that_starts_an_interactive_prompt_holds_interactive_work_only():
    s = make(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=64, max_model_len=64, interactive_prefill_alone=True)
    s.add_request(req("b1", 4, max_tokens=8, cls="batch", arrival=0))
    s.add_request(req("b2", 4, max_tokens=8, cls="batch", arrival=1))
    s.add_request(req("i1", 4, max_tokens=8, cls="interactive", arrival=2))
    out, _ = step(s)  # i1's prompt starts: its step is its own
    assert plan(out) == [("i1", 0, 4, True)]
    out, _ = step(s)
    assert plan(out) == [("i1", 4, 1, True), ("b1", 0, 4, True), ("b2", 0, 4, True)]
    s.add_request(req("i2", 20, max_tokens=8, cls="interactive", arrival=3))
    # i2's prompt (20 tokens, 16 a step) takes two steps: the running interactive
    # decode goes along, the batch decodes wait for both
    out, _ = step(s)
    assert plan(out) == [("i1", 5, 1, True), ("i2", 0, 15, False)]
    out, _ = step(s)
    assert plan(out) == [("i1", 6, 1, True), ("i2", 15, 5, True)]
    out, _ = step(s)  # nothing interactive to prefill: everyone decodes
    assert plan(out) == [("i1", 7, 1, True), ("i2", 20, 1, True), ("b1", 4, 1, True), ("b2", 4, 1, True)]


def test_interactive_prompt_alone_takes_a_batch_seat_for_free():
    # every seat is batch; the interactive prompt's own step preempts the newest
    # batch request, and no batch token was planned, so none is wasted
    s = make(
        max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64, max_model_len=128, interactive_prefill_alone=True
    )
    s.add_request(req("b1", 8, max_tokens=8, cls="batch", arrival=0))
    s.add_request(req("b2", 8, max_tokens=8, cls="batch", arrival=1))
    step(s)
    s.add_request(req("i", 4, cls="interactive", arrival=2))
    out, _ = step(s)
    assert plan(out) == [("i", 0, 4, True)] and out.preempted_req_ids == ["b2"]
    out, _ = step(s)
    assert plan(out) == [("i", 4, 1, True), ("b1", 8, 1, True)]


def test_interactive_prompt_that_cannot_start_leaves_the_batch_step_as_usual():
    # 10 usable blocks of 4 tokens: the batch request holds 9, the interactive
    # prompt needs 3 and cannot take them from a running decode: batch goes on
    s = make(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=11, max_model_len=40, interactive_prefill_alone=True)
    s.add_request(req("b", 33, max_tokens=4, cls="batch", arrival=0))
    step(s)
    assert s.allocator.num_free_blocks == 1
    s.add_request(req("i", 12, cls="interactive", arrival=1))
    out, _ = step(s)
    assert plan(out) == [("b", 33, 1, True)] and not out.preempted_req_ids
    assert s.get_request("i").status == RequestStatus.WAITING


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_capped(clock: FakeClock, **overrides) -> Scheduler:
    cfg = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=BS,
        num_blocks=64,
        enable_prefix_caching=False,
        interactive_prefill_alone=True,
        interactive_batch_prefill_tokens=6,
        interactive_recent_s=2.0,
        interactive_step_tokens=0,  # the prompt cap alone; the step cap's tests set their own
    )
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg), clock=clock)


def test_batch_prompts_get_the_whole_budget_when_no_interactive_work_was_seen():
    s = make_capped(FakeClock())
    s.add_request(req("b1", 20, cls="batch", arrival=0))
    s.add_request(req("b2", 20, cls="batch", arrival=1))
    out, _ = step(s)
    assert plan(out) == [("b1", 0, 20, True), ("b2", 0, 20, True)]


def test_batch_prompt_tokens_are_capped_while_interactive_work_runs_and_decodes_are_not():
    clock = FakeClock()
    s = make_capped(clock, max_num_seqs=6)
    for k in range(3):
        s.add_request(req(f"d{k}", 2, max_tokens=20, cls="batch", arrival=k))
    step(s)  # three batch decoders
    s.add_request(req("i", 4, max_tokens=20, cls="interactive", arrival=3))
    out, _ = step(s)
    assert plan(out) == [("i", 0, 4, True)]  # its own step
    s.add_request(req("p", 10, cls="batch", arrival=4))
    s.add_request(req("q", 10, cls="batch", arrival=5))
    out, _ = step(s)
    # every decode, then 6 batch prompt tokens: p's first chunk, q waits
    assert plan(out) == [
        ("i", 4, 1, True),
        ("d0", 2, 1, True),
        ("d1", 2, 1, True),
        ("d2", 2, 1, True),
        ("p", 0, 6, False),
    ]
    out, _ = step(s)
    assert plan(out) == [
        ("i", 5, 1, True),
        ("d0", 3, 1, True),
        ("d1", 3, 1, True),
        ("d2", 3, 1, True),
        ("p", 6, 4, True),
        ("q", 0, 2, False),
    ]


def test_the_cap_lasts_interactive_recent_s_after_the_last_interactive_request():
    clock = FakeClock()
    s = make_capped(clock)
    s.add_request(req("i", 4, max_tokens=1, cls="interactive", arrival=0))
    _, fin = step(s)
    assert fin == ["i"]
    clock.now += 1.9
    s.add_request(req("b1", 20, max_tokens=1, cls="batch", arrival=1))
    out, _ = step(s)
    assert plan(out) == [("b1", 0, 6, False)]  # 1.9 s after: still capped
    clock.now += 0.1
    out, _ = step(s)
    assert plan(out) == [("b1", 6, 14, True)]  # 2.0 s after: the whole budget again


def test_a_mixed_step_caps_its_batch_prompt_tokens():
    # interactive_prefill_alone off: the interactive prompt shares its step,
    # and the batch prompt beside it gets the capped share
    clock = FakeClock()
    s = make_capped(clock, interactive_prefill_alone=False)
    s.add_request(req("b1", 20, max_tokens=4, cls="batch", arrival=0))
    s.add_request(req("i", 30, max_tokens=4, cls="interactive", arrival=1))
    out, _ = step(s)
    assert plan(out) == [("i", 0, 30, True), ("b1", 0, 6, False)]


def test_interactive_cap_of_zero_means_no_cap():
    clock = FakeClock()
    s = make_capped(clock, interactive_batch_prefill_tokens=0)
    s.add_request(req("i", 4, max_tokens=8, cls="interactive", arrival=0))
    step(s)
    s.add_request(req("b1", 20, cls="batch", arrival=1))
    out, _ = step(s)
    assert plan(out) == [("i", 4, 1, True), ("b1", 0, 20, True)]


def test_batch_decodes_take_turns_within_the_step_cap_while_interactive_work_runs():
    clock = FakeClock()
    s = make_capped(clock, max_num_seqs=6, interactive_step_tokens=3)
    for k in range(4):
        s.add_request(req(f"d{k}", 2, max_tokens=20, cls="batch", arrival=k))
    out, _ = step(s)  # no interactive work seen yet: every batch prompt at once
    assert plan(out) == [(f"d{k}", 0, 2, True) for k in range(4)]
    s.add_request(req("i", 4, max_tokens=20, cls="interactive", arrival=4))
    out, _ = step(s)
    assert plan(out) == [("i", 0, 4, True)]  # its own step
    # then three tokens a step: the interactive decode and two batch decodes,
    # least recently served first
    out, _ = step(s)
    assert plan(out) == [("i", 4, 1, True), ("d0", 2, 1, True), ("d1", 2, 1, True)]
    out, _ = step(s)
    assert plan(out) == [("i", 5, 1, True), ("d2", 2, 1, True), ("d3", 2, 1, True)]
    out, _ = step(s)
    assert plan(out) == [("i", 6, 1, True), ("d0", 3, 1, True), ("d1", 3, 1, True)]
    s.abort("i")
    out, _ = step(s)  # interactive work seen just now: still capped; d1 was served last
    assert plan(out) == [("d0", 4, 1, True), ("d2", 3, 1, True), ("d3", 3, 1, True)]
    clock.now += 2.0  # interactive_recent_s after the last interactive work
    out, _ = step(s)
    assert plan(out) == [("d0", 5, 1, True), ("d1", 4, 1, True), ("d2", 4, 1, True), ("d3", 4, 1, True)]


def test_interactive_decodes_are_never_cut_by_the_step_cap():
    clock = FakeClock()
    s = make_capped(clock, max_num_seqs=6, interactive_step_tokens=2)
    s.add_request(req("d", 2, max_tokens=20, cls="batch", arrival=0))
    step(s)
    for k in range(3):
        s.add_request(req(f"i{k}", 2, max_tokens=20, cls="interactive", arrival=1 + k))
    step(s)  # the interactive prompts' own step
    out, _ = step(s)
    assert plan(out) == [("i0", 2, 1, True), ("i1", 2, 1, True), ("i2", 2, 1, True)]  # the batch decode waits
    s.abort("i1")
    s.abort("i2")
    out, _ = step(s)
    assert plan(out) == [("i0", 3, 1, True), ("d", 2, 1, True)]


def test_batch_prompt_chunks_get_what_the_decodes_leave_of_the_step_cap():
    clock = FakeClock()
    s = make_capped(clock, max_num_seqs=6, interactive_step_tokens=5)
    for k in range(3):
        s.add_request(req(f"d{k}", 2, max_tokens=20, cls="batch", arrival=k))
    step(s)
    s.add_request(req("i", 4, max_tokens=20, cls="interactive", arrival=3))
    step(s)  # i's own step
    s.add_request(req("p", 10, cls="batch", arrival=4))
    out, _ = step(s)
    # four decodes, then one prompt token: five tokens in all (the prompt
    # cap alone, 6, would have given p six)
    assert plan(out) == [
        ("i", 4, 1, True),
        ("d0", 2, 1, True),
        ("d1", 2, 1, True),
        ("d2", 2, 1, True),
        ("p", 0, 1, False),
    ]


def test_the_step_cap_leaves_batch_only_serving_alone():
    s = make_capped(FakeClock(), max_num_seqs=6, interactive_step_tokens=2)
    for k in range(4):
        s.add_request(req(f"d{k}", 2, max_tokens=20, cls="batch", arrival=k))
    step(s)
    out, _ = step(s)
    assert plan(out) == [(f"d{k}", 2, 1, True) for k in range(4)]


@pytest.mark.parametrize(
    "field,value",
    [
        ("interactive_step_tokens", -1),
        ("interactive_step_tokens", 2.5),
        ("interactive_batch_prefill_tokens", -1),
        ("interactive_batch_prefill_tokens", 1.5),
        ("interactive_recent_s", -0.1),
        ("interactive_recent_s", float("nan")),
        ("interactive_recent_s", float("inf")),
        ("interactive_recent_s", True),
    ],
)
def test_interactive_cap_settings_are_validated(field, value):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=BS, num_blocks=64)
    cfg[field] = value
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**cfg)
