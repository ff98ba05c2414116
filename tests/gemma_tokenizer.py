"""A tiny Gemma-style SentencePiece tokenizer and Gemma's chat templates, for the Gemma tests.

llama.cpp's Gemma 2 converter reads only a SentencePiece ``tokenizer.model``
(Gemma 3's reads one when it is there), so a Gemma checkpoint converted in
the tests needs one. :func:`with_gemma_tokenizer` trains it on
``models/corpus.txt`` with Gemma's settings (BPE pieces, byte fallback, no
dummy prefix, digits split, text kept as it is; ``<pad>`` ``<eos>`` ``<bos>``
``<unk>`` as ids 0-3, ``<start_of_turn>`` / ``<end_of_turn>`` as pieces) and
writes beside it what a Gemma folder ships: ``tokenizer.json`` (made by
transformers from the model), ``tokenizer_config.json`` with the turn tokens
marked special (``added_tokens_decoder``, as Google's files mark them) and
the chat template.

The templates are the ones Google's checkpoints ship (data the tests render,
as a user's folder would hold them): Gemma 2's refuses a system message,
Gemma 3's folds it into the first user turn.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "models" / "corpus.txt"
#: pieces the trained model has (SentencePiece may stop short on a small corpus)
PIECES = 600
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
TURNS = ("<start_of_turn>", "<end_of_turn>")

GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


def train_model(path: str | os.PathLike) -> None:
    """Train the SentencePiece model into ``path`` (one thread: the same file every time)."""
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "tokenizer")
        spm.SentencePieceTrainer.train(
            input=str(CORPUS),
            model_prefix=prefix,
            model_type="bpe",
            vocab_size=PIECES,
            byte_fallback=True,
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            normalization_rule_name="identity",
            split_digits=True,
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            pad_piece="<pad>",
            eos_piece="<eos>",
            bos_piece="<bos>",
            unk_piece="<unk>",
            user_defined_symbols=list(TURNS),
            hard_vocab_limit=False,
            num_threads=1,
            minloglevel=2,
        )
        shutil.copy(prefix + ".model", path)


def with_gemma_tokenizer(folder: str | os.PathLike, template: str = GEMMA2_TEMPLATE) -> str:
    """Write the Gemma-style tokenizer files into ``folder`` (see the module docstring)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    train_model(folder / "tokenizer.model")
    base = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
    }
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(folder / "tokenizer.model", Path(tmp) / "tokenizer.model")
        _write_json(Path(tmp) / "tokenizer_config.json", base)
        AutoTokenizer.from_pretrained(tmp).save_pretrained(tmp)
        tokenizer = json.loads((Path(tmp) / "tokenizer.json").read_text(encoding="utf-8"))
    for added in tokenizer["added_tokens"]:  # the turn tokens are special in Google's files
        added["special"] = True
    _write_json(folder / "tokenizer.json", tokenizer)
    decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIALS + TURNS)
    }
    _write_json(folder / "tokenizer_config.json", {**base, "added_tokens_decoder": decoder, "chat_template": template})
    return os.fspath(folder)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
