"""Sampling parameters at the engine's door: every value that reaches a
device array is range- and finiteness-checked (refused with
invalid_request naming the field), and seeds outside uint32 are accepted,
folded deterministically, and sample reproducibly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine_fixtures import build_engine_checkpoint
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.engine.sampler import host_sampling_tensors, sampler_seed
from jaxserve.engine.step_inputs import sampling_row
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams

BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2**31),
    ("max_tokens", 4.0),
    ("max_tokens", True),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", -0.5),
    ("temperature", 100.5),
    ("temperature", "0.7"),
    ("temperature", None),
    ("temperature", 10**400),
    ("top_p", math.nan),
    ("top_p", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("top_k", 2**31),
    ("top_k", 2**40),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", math.nan),
    ("min_p", math.inf),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("seed", -(2**63) - 1),
    ("seed", 2**64),
    ("seed", 2**70),
    ("seed", 1.0),
    ("seed", True),
    ("seed", "1"),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 1e-40),
    ("repetition_penalty", 1e39),
    ("frequency_penalty", math.nan),
    ("frequency_penalty", math.inf),
    ("frequency_penalty", 2.5),
    ("presence_penalty", math.nan),
    ("presence_penalty", -math.inf),
    ("presence_penalty", -2.5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**31]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("logprobs", 1),
    ("logprobs", "yes"),
    ("logprobs", None),
    ("ignore_eos", 1),
    ("stop", [""]),
    ("stop", 5),
]


@pytest.mark.parametrize("field,value", BAD_VALUES, ids=[f"{f}={v!r}"[:40] for f, v in BAD_VALUES])
def test_validate_refuses_each_out_of_range_value(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(RequestError) as info:
        params.validate()
    assert info.value.code == "invalid_request"
    assert info.value.message.startswith(f"{field} must be ")
    assert repr(value) in info.value.message


@pytest.mark.parametrize(
    "field,value",
    [
        ("seed", -(2**63)),
        ("seed", -1),
        ("seed", 0),
        ("seed", 2**32 - 1),
        ("seed", 2**32),
        ("seed", 2**64 - 1),
        ("seed", np.int64(-5)),
        ("top_k", 0),
        ("top_k", 2**31 - 1),
        ("max_tokens", 2**31 - 1),
        ("temperature", 0),
        ("temperature", 100.0),
        ("temperature", np.float32(0.7)),
        ("repetition_penalty", 1e-30),
        ("frequency_penalty", -2.0),
        ("presence_penalty", 2),
        ("stop_token_ids", (0, 2**31 - 1)),
        ("stop_token_ids", [np.int32(3)]),
        ("stop", "x"),
    ],
)
def test_validate_accepts_the_boundaries(field, value):
    SamplingParams(**{field: value}).validate()


def test_sampler_seed_is_identity_on_uint32_and_folds_the_rest():
    for seed in (0, 1, 12345, 2**31, 2**32 - 1):
        assert sampler_seed(seed) == seed  # seeded outputs from before are unchanged
    wide = [-(2**63), -2, -1, 2**32, 2**40, 2**63, 2**64 - 1]
    folded = [sampler_seed(s) for s in wide]
    assert all(0 <= f < 2**32 for f in folded)
    assert folded == [sampler_seed(s) for s in wide]  # deterministic
    # taken modulo 2**64: -1 is 2**64 - 1 and -2**63 is 2**63; no other pair coincides
    assert sampler_seed(-1) == sampler_seed(2**64 - 1) and sampler_seed(-(2**63)) == sampler_seed(2**63)
    assert len(set(folded)) == len(wide) - 2
    # no systematic collision of small negative seeds with small positive ones
    assert not {sampler_seed(-k) for k in range(1, 200)} & set(range(200))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    checkpoint = build_engine_checkpoint(tmp_path_factory.mktemp("params-ckpt"))
    engine = Engine(
        EngineArgs(model=str(checkpoint), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=16)
    )
    engine.warmup()
    return engine


def _refused(engine, params: SamplingParams, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        engine.add_request("x", [11, 12, 13], params, **kw)
    assert not engine.has_unfinished()  # nothing half-admitted
    return info.value


def test_add_request_checks_the_vocabulary_bounds(engine):
    vocab = engine.model_config.vocab_size
    err = _refused(engine, SamplingParams(top_k=vocab + 1))
    assert err.code == "invalid_request" and err.message.startswith("top_k must be in [0, ")
    assert str(vocab + 1) in err.message
    err = _refused(engine, SamplingParams(stop_token_ids=[5, vocab]))
    assert err.code == "invalid_request" and err.message.startswith("stop_token_ids")
    assert str(vocab) in err.message
    err = _refused(engine, SamplingParams(seed=-1, temperature=0.7, top_k=2**40))
    assert err.code == "invalid_request" and "top_k" in err.message and str(2**40) in err.message
    err = _refused(engine, SamplingParams(), deadline="soon")
    assert err.code == "invalid_request" and "deadline" in err.message and "'soon'" in err.message
    err = _refused(engine, SamplingParams(), deadline=math.nan)
    assert err.code == "invalid_request" and "deadline" in err.message
    with pytest.raises(RequestError) as info:
        engine.add_request("x", [11, "12"], SamplingParams())
    assert info.value.code == "invalid_request" and "'12'" in info.value.message
    assert not engine.has_unfinished()
    # the bounds themselves are fine
    engine.add_request("ok", [11, 12], SamplingParams(max_tokens=2, top_k=vocab, stop_token_ids=[vocab - 1]))
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.7, seed=seed, ignore_eos=True)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.token_ids
    return done


WIDE_SEEDS = [-1, 2**40, 2**64 - 1, -(2**63)]


def test_seeds_outside_uint32_sample_reproducibly_in_any_batch(engine):
    prompt = [101, 7, 250, 33, 19]
    alone = {seed: _run(engine, {"s": (prompt, _sampled(seed))})["s"] for seed in WIDE_SEEDS}
    assert all(len(tokens) == 10 for tokens in alone.values())
    # -1 and 2**64 - 1 are one seed modulo 2**64; the others give other streams
    assert alone[-1] == alone[2**64 - 1]
    assert len({tuple(alone[s]) for s in (-1, 2**40, -(2**63))}) == 3
    # the same seed again, now sharing the batch with other requests (greedy
    # and sampled, other prompts): the same tokens
    together = _run(
        engine,
        {
            **{f"w{i}": (prompt, _sampled(seed)) for i, seed in enumerate(WIDE_SEEDS[:3])},
            "g": ([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=6, temperature=0.0)),
        },
    )
    assert [together[f"w{i}"] for i in range(3)] == [alone[s] for s in WIDE_SEEDS[:3]]
    together = _run(
        engine,
        {
            "other": ([300, 301, 302], _sampled(7)),
            "w3": (prompt, _sampled(WIDE_SEEDS[3])),
        },
    )
    assert together["w3"] == alone[WIDE_SEEDS[3]]


def test_the_reported_job_runs(engine):
    """{"temperature": 0.7, "seed": -1} used to raise OverflowError while the
    step's sampler arrays were built, failing every request of the step."""
    got = _run(
        engine,
        {
            "seed-1": ([11, 12, 13, 14], SamplingParams(max_tokens=5, temperature=0.7, seed=-1)),
            "seed2**64-1": ([15, 16], SamplingParams(max_tokens=5, temperature=0.7, seed=2**64 - 1)),
            "plain": ([17, 18, 19], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
        },
    )
    assert sorted(got) == ["plain", "seed-1", "seed2**64-1"]
    assert len(got["plain"]) == 5
    # the sampler's seed array carries the request's seed folded into uint32
    engine.add_request("row", [11, 12], SamplingParams(max_tokens=1, temperature=0.7, seed=-1))
    row = sampling_row(engine.scheduler.get_request("row"))
    (seed,) = host_sampling_tensors([row], 1, 0)["seed"]
    assert seed == sampler_seed(-1) and 0 <= seed < 2**32
    engine.abort("row")
