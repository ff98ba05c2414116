"""Phi-3, SmolLM3 and OLMo 2 beyond the shared parity tests: config reading, stop tokens, the CLI.

The shared tests (``test_model_parity.py``, ``test_family_engine_parity.py``,
``test_family_gguf.py``) compare every fixture with transformers; LongRoPE
has its own (``test_longrope.py``). Here: the config defaults these
families take from transformers when a config.json leaves a key out
(SmolLM3's NoPE interval, rope base and which layers slide; OLMo 2's
norms), the end-of-turn token of each family's chat template stopping
generation, and ``jaxserve generate --chat`` on a Phi-3 folder printing
text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

import model_fixtures as mf
from jaxserve.engine.engine import stop_token_ids
from jaxserve.models.config import ModelConfig
from jaxserve.models.errors import ModelLoadError
from jaxserve.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_smollm3_defaults_follow_transformers():
    c = ModelConfig.from_dict({"architectures": ["SmolLM3ForCausalLM"], **BASE})
    # every fourth layer has no rope; the base is SmolLM3's 2e6; embeddings tied
    assert c.rope_layers == (True, True, True, False, True, True, True, False)
    assert [c.layer_rope(i) is None for i in range(8)] == [not r for r in c.rope_layers]
    assert c.rope_theta == 2000000.0 and c.tie_word_embeddings
    assert c.layer_windows == (None,) * 8

    # a window slides the NoPE layers unless layer_types says otherwise
    c = ModelConfig.from_dict(
        {"architectures": ["SmolLM3ForCausalLM"], **BASE, "use_sliding_window": True, "sliding_window": 32}
    )
    assert c.layer_windows == tuple(None if r else 32 for r in c.rope_layers)

    # every layer with rope: no per-layer switch at all
    c = ModelConfig.from_dict({"architectures": ["SmolLM3ForCausalLM"], **BASE, "no_rope_layers": [1] * 8})
    assert c.rope_layers == ()

    with pytest.raises(ModelLoadError, match="no_rope_layers"):
        ModelConfig.from_dict({"architectures": ["SmolLM3ForCausalLM"], **BASE, "no_rope_layers": [1, 0]})


def test_olmo2_has_post_norms_and_full_qk_norms():
    c = ModelConfig.from_dict({"architectures": ["Olmo2ForCausalLM"], **BASE})
    assert c.norms == ("attn_out", "ffn_out") and c.qk_norm == "full"
    assert c.rms_norm_eps == 1e-5  # Olmo2Config's default


def test_phi3_without_longrope_reads_plain_rope():
    """Phi-3-mini-4k: no rope scaling, a window of 2047 in a context of 4096."""
    c = ModelConfig.from_dict(
        {
            "architectures": ["Phi3ForCausalLM"],
            **BASE,
            "max_position_embeddings": 4096,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "sliding_window": 2047,
        }
    )
    assert c.rope.rope_type == "default" and c.rope.attention_factor == 1.0
    assert c.layer_windows == (2047,) * 8 and c.rotary_dim is None


@pytest.mark.parametrize(
    "name, token",
    [("phi3", "<|end|>"), ("phi4mini", "<|end|>"), ("smollm3", "<|im_end|>"), ("olmo2", "<|endoftext|>")],
)
def test_end_of_turn_token_stops_generation(name, token, tmp_path):
    folder = mf.with_tokenizer(mf.FAMILIES[name](str(tmp_path / name)))
    path = os.path.join(folder, "tokenizer.json")
    hf = HFTokenizer.from_file(path)
    hf.add_special_tokens([AddedToken(token, special=True)])
    hf.save(path)
    tok = Tokenizer.from_folder(folder)
    token_id = tok.token_to_id(token)
    assert token_id is not None
    stops = stop_token_ids(tok, ModelConfig.from_folder(folder))
    assert token_id in stops and set(tok.eos_token_ids) <= set(stops)


def test_generate_chat_on_a_phi3_folder_prints_text(tmp_path):
    folder = mf.with_tokenizer(mf.phi4mini(str(tmp_path / "phi4mini")))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["JAXSERVE_STATE_DIR"] = str(tmp_path / "state")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "generate", "--model", folder, "--chat", "--max-tokens", "5", "--json"]
        + ["Name a river."],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout)
    assert isinstance(out["text"], str) and 1 <= out["usage"]["completion_tokens"] <= 5

    # a broken LongRoPE config is one line naming the file and the fault
    mf.edit_config(folder, lambda d: d["rope_parameters"].update(long_factor=[1.0, 2.0]))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "generate", "--model", folder, "--chat", "Name a river."],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    [line] = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert "config.json" in line and "long_factor" in line, line
