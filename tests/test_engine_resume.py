"""A request added with output an earlier run produced (``Engine.add_request(
prior=...)``, how a worker continues a job whose first worker died) goes on
exactly as the earlier run would have: the same tokens and text for greedy,
seeded, penalised, stop-string and structured requests, the saved logprobs
given back, and deltas that still concatenate to the whole text."""

from __future__ import annotations

import pytest

from engine_fixtures import build_engine_checkpoint
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.engine.structured import json_schema_constraint
from jaxserve.engine.types import PriorOutput, RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 40
PROMPT = "Once upon a time, in a land far away"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = build_engine_checkpoint(tmp_path_factory.mktemp("resume-ckpt"))
    engine = Engine(EngineArgs(model=str(folder), max_num_seqs=8, max_model_len=128, block_size=16))
    engine.warmup()
    return engine


PARAMS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, seed=11, frequency_penalty=1.0, presence_penalty=0.5, ignore_eos=True
    ),
    "logprobs": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, logprobs=True, top_logprobs=3),
    "structured": SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
        structured=json_schema_constraint({"type": "object", "properties": {"name": {"type": "string"}}}),
    ),
}


def _run(engine: Engine, requests: dict[str, tuple[SamplingParams, PriorOutput | None]]):
    """Every request in one batch: (final outputs, each one's deltas) by id."""
    for rid, (params, prior) in requests.items():
        engine.add_request(rid, PROMPT, params, prior=prior)
    finals: dict[str, RequestOutput] = {}
    deltas: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            deltas[out.request_id].append(out)
            if out.finished:
                finals[out.request_id] = out
    return finals, deltas


def _prior(out: RequestOutput, n: int) -> PriorOutput:
    return PriorOutput(
        tuple(out.token_ids[:n]),
        None if out.logprobs is None else tuple(out.logprobs[:n]),
        None if out.top_logprobs is None else tuple(tuple(x) for x in out.top_logprobs[:n]),
    )


@pytest.fixture(scope="module")
def uninterrupted(engine):
    finals, _ = _run(engine, {f"whole-{name}": (p, None) for name, p in PARAMS.items()})
    return {name: finals[f"whole-{name}"] for name in PARAMS}


@pytest.mark.parametrize("saved", [1, 13, MAX_TOKENS - 1])
def test_a_resumed_request_continues_as_the_uninterrupted_run(engine, uninterrupted, saved):
    priors = {name: _prior(out, min(saved, len(out.token_ids) - 1)) for name, out in uninterrupted.items()}
    finals, deltas = _run(engine, {f"resumed-{name}": (PARAMS[name], priors[name]) for name in PARAMS})
    for name in PARAMS:
        whole, resumed = uninterrupted[name], finals[f"resumed-{name}"]
        assert resumed.token_ids == whole.token_ids and resumed.text == whole.text, name
        assert resumed.finish_reason == whole.finish_reason and resumed.completion_tokens == whole.completion_tokens
        # its deltas are the whole text (the first carries the saved part), its new tokens the rest
        outs = deltas[f"resumed-{name}"]
        assert "".join(o.new_text for o in outs) == whole.text
        assert sum(len(o.new_token_ids) for o in outs) == len(whole.token_ids) - len(priors[name].token_ids)
    lp_whole, lp_resumed = uninterrupted["logprobs"], finals["resumed-logprobs"]
    n = len(priors["logprobs"].token_ids)
    assert lp_resumed.logprobs is not None and lp_whole.logprobs is not None
    assert lp_resumed.logprobs[:n] == lp_whole.logprobs[:n]  # the saved ones, given back as they were
    assert lp_resumed.logprobs[n:] == pytest.approx(lp_whole.logprobs[n:], abs=1e-4)  # computed again
    assert lp_resumed.top_logprobs is not None and len(lp_resumed.top_logprobs) == len(lp_whole.token_ids)


def test_saved_output_that_ends_the_request_is_sampled_again(engine, uninterrupted):
    """Every token of a finished output saved (a worker that died before it
    stored the result): the last one, which ended the request, is sampled
    again and ends it the same way; so does a stop string."""
    whole = uninterrupted["greedy"]
    params = PARAMS["greedy"]
    stop_at = whole.text[len(whole.text) // 2 :][:3]
    stopped = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop_at])
    first, _ = _run(engine, {"stop-whole": (stopped, None)})
    finals, _ = _run(
        engine,
        {
            "all-saved": (params, _prior(whole, len(whole.token_ids))),
            "stop-saved": (stopped, PriorOutput(tuple(whole.token_ids))),
        },
    )
    assert finals["all-saved"].token_ids == whole.token_ids and finals["all-saved"].finish_reason == "length"
    assert finals["stop-saved"].text == first["stop-whole"].text and finals["stop-saved"].finish_reason == "stop"


def test_a_prior_output_the_request_cannot_have_produced_is_refused(engine):
    with pytest.raises(RequestError, match="out of range"):
        engine.add_request("bad-ids", PROMPT, PARAMS["greedy"], prior=PriorOutput((10, 10**6)))
    with pytest.raises(RequestError, match="logprobs"):
        engine.add_request("no-logprobs", PROMPT, PARAMS["logprobs"], prior=PriorOutput((10, 11)))
    assert not engine.has_unfinished()
