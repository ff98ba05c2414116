"""Scheduler: label scoring's prefill-only parents, their forks and score
rows, with exact block ids (host bookkeeping only, no model)."""

from __future__ import annotations

from jaxserve.engine.config import SchedulerConfig
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

BS = 4
GREEDY1 = SamplingParams(max_tokens=1, temperature=0.0)


def make(**overrides) -> Scheduler:
    cfg = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=BS,
        num_blocks=32,
        enable_prefix_caching=False,
    )
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def score_job(rid: str, prompt: list[int], labels: list[list[int]]) -> Request:
    """What Engine.add_score_request builds: a parent computing all but the
    prompt's last token, and one fork per label computing that token and
    the label's tokens but its last, every position a score row."""
    parent = Request(rid, prompt[:-1], GREEDY1)
    parent.prefill_only = True
    for i, label in enumerate(labels):
        child = Request(f"{rid}/{i}", prompt + label[:-1], GREEDY1)
        child.score_from = len(prompt) - 1
        child.score_targets = list(label)
        parent.fork_children.append(child)
    return parent


def run_step(s: Scheduler):
    out = s.schedule()
    return out, s.update_from_output(out, {})


def test_forks_share_full_blocks_and_copy_the_partial_one():
    s = make()
    prompt = list(range(100, 111))  # 11 tokens: the parent computes 10 = 2 full blocks + 2 tokens
    s.add_request(score_job("j", prompt, [[7, 8, 9], [5]]))
    out, _ = run_step(s)
    [p] = out.scheduled
    assert (p.request_id, p.start_position, p.num_scheduled_tokens, p.sample, p.score_targets) == (
        "j",
        0,
        10,
        False,
        [],
    )
    assert p.block_ids == [1, 2, 3]
    parent = s.get_request("j")
    assert parent.status == RequestStatus.PARKED and s.num_running == 0
    out, finished = run_step(s)
    # both forks start at position 10 on the shared blocks 1 and 2 and a copy of block 3
    assert out.block_copies == [(3, 4), (3, 5)]
    got = {x.request_id: (x.start_position, x.token_ids, x.block_ids, x.score_targets, x.sample) for x in out.scheduled}
    assert got == {
        # j/0 also needs a fourth block for position 12: the parent's freed block 3
        # (the copies are made before the step's forward writes into it)
        "j/0": (10, [110, 7, 8], [1, 2, 4, 3], [7, 8, 9], False),
        "j/1": (10, [110], [1, 2, 5], [5], False),
    }
    assert s.get_request("j") is None  # the parent finished once its forks started
    assert sorted(finished) == ["j/0", "j/1"] and s.num_running == 0
    assert s.allocator.num_free_blocks == s.allocator.num_usable_blocks


def test_score_rows_share_the_steps_logits_rows():
    s = make(max_num_seqs=4)
    s.add_request(score_job("j", list(range(100, 105)), [[1, 2, 3, 4, 5, 6], [7, 8, 9]]))
    run_step(s)
    out, _ = run_step(s)
    # 4 logits rows per step: the first fork takes them all (its chunk is cut
    # to 4 score rows), the second waits for the next step
    assert [(x.request_id, x.num_scheduled_tokens, len(x.score_targets)) for x in out.scheduled] == [("j/0", 4, 4)]
    assert sum(x.num_logits_rows for x in out.scheduled) == 4
    out, _ = run_step(s)
    assert [(x.request_id, x.start_position, x.score_targets) for x in out.scheduled] == [
        ("j/0", 8, [5, 6]),
        ("j/1", 4, [7, 8]),
    ]
    out, _ = run_step(s)
    assert [(x.request_id, x.score_targets) for x in out.scheduled] == [("j/1", [9])]


def test_forks_wait_for_sequence_slots():
    s = make(max_num_seqs=2)
    s.add_request(score_job("j", list(range(100, 109)), [[1], [3], [5]]))
    run_step(s)
    out, _ = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["j/0", "j/1"]
    assert s.get_request("j").status == RequestStatus.PARKED  # holds its blocks for the third
    out, _ = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["j/2"] and out.block_copies == []  # 8 tokens: no partial block
    assert s.get_request("j") is None


def test_a_prompt_ending_on_a_block_boundary_needs_no_copy():
    s = make()
    s.add_request(score_job("j", list(range(100, 109)), [[1, 2]]))  # the parent computes 8 = 2 full blocks
    run_step(s)
    out, _ = run_step(s)
    [c] = out.scheduled
    assert out.block_copies == [] and c.block_ids == [1, 2, 3] and c.start_position == 8


def test_aborting_a_parked_parent_drops_its_unstarted_forks():
    s = make(max_num_seqs=1)
    s.add_request(score_job("j", list(range(100, 109)), [[1, 2], [3, 4]]))
    run_step(s)
    out, _ = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["j/0"]
    assert s.abort("j") and s.get_request("j/1") is None
    assert s.abort("j/0")
    assert s.allocator.num_free_blocks == s.allocator.num_usable_blocks and not s.has_unfinished()
