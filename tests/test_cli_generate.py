"""``jaxserve generate --json`` on a checkpoint folder equals transformers."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import torch

from engine_fixtures import build_engine_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_engine_checkpoint(tmp_path_factory.mktemp("cli-ckpt"), seed=11)


def test_generate_json_matches_transformers_generate(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The quick brown fox jumps over"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxserve",
            "generate",
            "--model",
            str(checkpoint),
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--json",
            prompt,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout  # logs go to stderr; stdout is one JSON object
    got = orjson.loads(lines[0])

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
    expected = out[0, ids.shape[1] :].tolist()
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    for i, t in enumerate(expected):  # transformers keeps the EOS it stopped on; jaxserve excludes it
        if t in eos:
            expected = expected[:i]
            break
    assert got["token_ids"] == expected
    assert got["text"] == tok.decode(expected, skip_special_tokens=True)
    assert got["usage"]["completion_tokens"] == len(expected)


def test_generate_plain_prints_text_and_bad_model_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "generate", "--model", str(tmp_path / "nope"), "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "nope" in proc.stderr
