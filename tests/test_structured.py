"""Structured output under token masks (jaxserve/engine/structured.py, the
sampler's mask): every constrained output parses and validates, regex and
choice jobs match, unconstrained neighbours keep their tokens, bad
constraints are refused, grammars compile once, and the matcher follows
preemption and failures.

The engine runs the engine-test checkpoint (tests/engine_fixtures.py: the
tiny tokenizer, logits large enough that greedy picks never hinge on a near
tie) with a KV cache small enough that the big batch preempts."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxserve.engine.llm import LLM
from jaxserve.engine.structured import StructuredBackend, json_schema_constraint
from jaxserve.kernels.kv_cache import bytes_per_block
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams, StructuredOutput
from tests.engine_fixtures import build_engine_checkpoint

pytestmark = pytest.mark.timeout(1200)

SCHEMAS = [
    {  # nested object, required fields, bounded integer, boolean
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["person", "active"],
        "additionalProperties": False,
    },
    {  # array of enums with item bounds
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {  # numbers with bounds (inclusive and exclusive)
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
    {  # an optional field, an enum with null
        "type": "object",
        "properties": {
            "kind": {"enum": ["a", "b", None]},
            "note": {"type": "string", "maxLength": 5},
        },
        "required": ["kind"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {  # alternatives: a small integer or a two-letter pattern
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "pattern": "^[a-c]{2}$"}]
    },
]

PROMPTS = ["Extract the record:", "JSON please", "The answer is", "Fill the form"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = build_engine_checkpoint(tmp_path_factory.mktemp("structured_ckpt"))
    block_size = 16
    per_block = bytes_per_block(2, block_size, 2, 16, np.float32)
    return LLM(
        str(folder),
        max_num_seqs=64,
        max_model_len=256,
        max_num_batched_tokens=256,
        block_size=block_size,
        kv_cache_memory=48 * per_block,
    )


def test_json_schema_outputs_parse_and_validate_over_many_sampled_jobs(llm):
    engine = llm.engine
    preemptions = engine.scheduler.num_preemptions
    compiled = engine.structured.num_compiled
    jobs = [(SCHEMAS[i % len(SCHEMAS)], PROMPTS[i % len(PROMPTS)]) for i in range(216)]
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=1000 + i, structured=json_schema_constraint(schema))
        for i, (schema, _) in enumerate(jobs)
    ]
    outs = llm.generate([p for _, p in jobs], params)
    for (schema, _), out in zip(jobs, outs):
        assert out.error is None, out.error
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    # varied outputs, not one string per schema
    assert len({o.text for o in outs}) > 120
    # each distinct schema compiled once, the batch preempted (the matchers
    # were replayed on recompute)
    assert engine.structured.num_compiled - compiled <= len(SCHEMAS)
    assert engine.scheduler.num_preemptions > preemptions


def test_regex_and_choice_jobs_match(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}( [A-Z])?"
    choices = ("positive", "negative", "neutral", 'it\'s "mixed"')
    params = []
    for i in range(24):
        spec = StructuredOutput("regex", regex) if i % 2 else StructuredOutput("choice", choices)
        params.append(SamplingParams(max_tokens=32, temperature=1.0 if i % 3 else 0.0, seed=i, structured=spec))
    outs = llm.generate(["Classify:"] * len(params), params)
    for p, out in zip(params, outs):
        assert out.finish_reason == "stop", out
        if p.structured.kind == "regex":
            assert re.fullmatch(regex, out.text), out.text
        else:
            assert out.text in choices
    assert {o.text for p, o in zip(params, outs) if p.structured.kind == "choice"} - {choices[0]}, "always one choice"


def test_unconstrained_rows_get_the_tokens_they_get_alone(llm):
    free = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=6, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, seed=7, presence_penalty=0.5, ignore_eos=True),
    ]
    prompts = ["alpha beta", "gamma", "delta epsilon zeta", "eta"]
    alone = [o.token_ids for o in llm.generate(prompts, free)]
    constrained = [
        SamplingParams(max_tokens=40, temperature=t, seed=s, structured=json_schema_constraint(SCHEMAS[s % 6]))
        for s, t in [(1, 1.0), (2, 0.0), (3, 1.0), (4, 0.7), (5, 1.0), (6, 0.0)]
    ]
    mixed_params = [constrained[0], free[0], constrained[1], free[1], constrained[2], free[2], constrained[3]]
    mixed_params += [free[3], constrained[4], constrained[5]]
    mixed_prompts = ["x", prompts[0], "y", prompts[1], "z", prompts[2], "w", prompts[3], "v", "u"]
    outs = llm.generate(mixed_prompts, mixed_params)
    together = [o.token_ids for p, o in zip(mixed_params, outs) if p.structured is None]
    assert together == alone
    # and the constrained rows did constrain (the same prompt unconstrained differs)
    assert all(o.finish_reason in ("stop", "length") for o in outs)


def test_a_bad_schema_regex_or_grammar_is_invalid_request_naming_the_problem(llm):
    engine = llm.engine
    bad = {
        "bad type": json_schema_constraint({"type": "no-such-type"}),
        "unclosed": StructuredOutput("regex", "[a-"),
        "lark": StructuredOutput("grammar", "start: missing_rule"),
    }
    for what, spec in bad.items():
        with pytest.raises(RequestError) as info:
            engine.add_request(f"bad-{what}", "hi", SamplingParams(structured=spec))
        assert info.value.code == "invalid_request"
        assert "refused" in info.value.message, info.value.message
    assert "no-such-type" in _refusal(engine, bad["bad type"])
    with pytest.raises(RequestError, match="not valid JSON"):
        json_schema_constraint("{not json")
    with pytest.raises(RequestError, match="guided_choice"):
        SamplingParams(structured=StructuredOutput("choice", ())).validate()
    with pytest.raises(RequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput("regex", "a")).validate()
    assert not engine.has_unfinished()


def _refusal(engine, spec) -> str:
    try:
        engine.add_request("bad-again", "hi", SamplingParams(structured=spec))
    except RequestError as exc:
        return exc.message
    raise AssertionError("accepted")


def test_max_tokens_cut_says_length(llm):
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 40}}, "required": ["a"]}
    [out] = llm.generate(
        ["x"], [SamplingParams(max_tokens=5, temperature=1.0, seed=1, structured=json_schema_constraint(schema))]
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"a"')


def test_a_grammar_failure_mid_generation_fails_that_job_only(llm):
    """A matcher that meets a token it cannot accept (here: its mask is
    sabotaged to allow everything) fails its own job with a non-retryable
    error; the other jobs of the step finish normally."""
    engine = llm.engine
    spec = StructuredOutput("regex", "x{30}")
    engine.add_request("victim", "hello", SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=spec))
    engine.add_request("neighbour", "hello", SamplingParams(max_tokens=8, temperature=1.0, seed=4, structured=spec))
    engine.add_request("free", "hello", SamplingParams(max_tokens=8, temperature=1.0, seed=5))
    victim = engine._constraints["victim"]
    real_fill = engine.structured.fill_masks

    def sabotaged(items):
        masks = real_fill(items)
        for i, (constraint, _) in enumerate(items):
            if constraint is victim:
                masks[i] = -1
        return masks

    engine.structured.fill_masks = sabotaged
    done = {}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        del engine.structured.fill_masks
    assert done["victim"].finish_reason == "error"
    assert done["victim"].error.code == "internal" and not done["victim"].error.retryable
    assert "structured output failed" in done["victim"].error.message
    assert done["neighbour"].error is None and done["neighbour"].text == "x" * 8
    assert done["free"].error is None and done["free"].finish_reason in ("stop", "length")


def test_json_object_and_a_lark_grammar(llm):
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    params = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=s, structured=StructuredOutput("grammar", lark))
        for s in range(6)
    ]
    params += [SamplingParams(max_tokens=200, temperature=0.0, structured=StructuredOutput("json_object"))]
    outs = llm.generate(["numbers:"] * len(params), params)
    for out in outs[:-1]:
        if out.finish_reason == "stop":
            assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", out.text), out.text
        else:
            assert re.fullmatch(r"\([0-9,]*", out.text), out.text
    if outs[-1].finish_reason == "stop":
        assert isinstance(json.loads(outs[-1].text), dict)
    assert outs[-1].text.startswith("{")


# ------------------------------------------------------------- no engine


@pytest.fixture(scope="module")
def backend():
    from jaxserve.presets import resolve_model

    folder = resolve_model("tiny")
    cfg = json.loads((folder / "config.json").read_text())
    return StructuredBackend(folder / "tokenizer.json", cfg["vocab_size"], [cfg["eos_token_id"]])


def _tokens_of(backend, text: str) -> list[int]:
    return backend._llg_tokenizer().tokenize_str(text)


def test_the_matcher_replays_a_cut_back_output(backend):
    """Preemption or a recomputed step may cut a request's output back: the
    mask after the cut is the one a fresh matcher gives."""
    spec = json_schema_constraint(SCHEMAS[0])
    ids = _tokens_of(backend, '{"person":{"name":"ab","age":12},"active":true}')
    c = backend.start(spec)
    c.fill_mask(ids[:9])
    after_cut = c.fill_mask(ids[:4])
    assert np.array_equal(after_cut, backend.start(spec).fill_mask(ids[:4]))
    assert np.array_equal(c.fill_mask(ids[:9]), backend.start(spec).fill_mask(ids[:9]))
    c.fill_mask(ids)
    assert c.is_accepting and c.error is None
    # a different token at the same length is a cut too
    c2 = backend.start(spec)
    c2.fill_mask(ids[:6])
    other = _tokens_of(backend, '{"active":')
    assert c2.fill_mask(other[:1]).tolist() == backend.start(spec).fill_mask(other[:1]).tolist()


def test_masks_have_the_model_vocab_width_and_allow_only_eos_at_the_end(backend):
    c = backend.start(StructuredOutput("choice", ("yes", "no")))
    row = c.fill_mask([])
    assert row.dtype == np.int32 and row.shape == (backend.num_words,)
    ids = _tokens_of(backend, "yes")
    end = c.fill_mask(ids)
    bits = np.unpackbits(end.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == backend.eos_token_ids


def test_a_steps_masks_filled_together_equal_one_row_at_a_time(backend):
    specs = [json_schema_constraint(SCHEMAS[i % len(SCHEMAS)]) for i in range(6)] + [
        StructuredOutput("regex", "[0-9]{4}")
    ]
    text = ['{"person":{"name":"ab', '{"tags":["red"', '{"score":1.', '{"kind":"a"', '[{"id":3', '"ab', "12"]
    outputs = [_tokens_of(backend, t) for t in text]
    batched = [backend.start(s) for s in specs]
    masks = backend.fill_masks(list(zip(batched, outputs)))
    assert masks.shape == (len(specs), backend.num_words)
    for spec, out, mask in zip(specs, outputs, masks):
        assert np.array_equal(mask, backend.start(spec).fill_mask(out))
    # a matcher that cannot take the output records an error; its row allows everything
    broken = backend.start(StructuredOutput("regex", "[0-9]+"))
    [row] = backend.fill_masks([(broken, _tokens_of(backend, "abc"))])
    assert broken.error is not None and (row == -1).all()


def test_grammars_compile_once_per_distinct_constraint(backend):
    before = backend.num_compiled
    schema = {"type": "object", "properties": {"q": {"type": "integer"}}}
    for _ in range(5):
        backend.start(json_schema_constraint(schema))
        backend.start(json_schema_constraint(json.dumps(schema)))
    backend.start(StructuredOutput("regex", "q+"))
    assert backend.num_compiled - before == 2


def test_the_sampler_applies_llguidances_bit_layout_to_masked_rows_only():
    import jax.numpy as jnp

    from jaxserve.engine.sampler import apply_token_mask, mask_words

    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32: the last word is partial
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    allowed = rng.random((3, vocab)) < 0.3
    words = np.zeros((3, mask_words(vocab)), np.uint32)
    for r, v in zip(*np.nonzero(allowed)):
        words[r, v // 32] |= np.uint32(1) << np.uint32(v % 32)
    masked = np.array([True, False, True])
    out = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(words.view(np.int32)), jnp.asarray(masked)))
    for r in range(3):
        if masked[r]:
            assert np.array_equal(out[r][allowed[r]], logits[r][allowed[r]])
            assert (out[r][~allowed[r]] <= -1e29).all()
        else:
            assert np.array_equal(out[r], logits[r])  # bit for bit
