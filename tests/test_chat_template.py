"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from jaxserve.presets import materialize_preset
from jaxserve.tokenizer import ChatTemplateError, Tokenizer, render_chat_template, validate_messages

DATA = Path(__file__).parent / "data"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

SYSTEM = {"role": "system", "content": "You are a terse assistant. Réponds en français si on te parle français."}
CHATS = {
    "single": [{"role": "user", "content": "Hello!"}],
    "multi": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "  And 3+3? 🤔\n"},
    ],
    "system_multi": [
        SYSTEM,
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "Oui, merci ! 你好"},
        {"role": "user", "content": 'Tell me a <b>joke</b> & "quote".'},
    ],
    "ends_with_assistant": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für eine Stadt — current weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "Use tools when helpful."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temperature": 21, "sky": "sonnig ☀"}'},
    {"role": "user", "content": "Thanks"},
]

TEMPLATES = ["llama3", "llama3_1", "qwen2", "qwen2_5", "mistral"]
# Mistral's template alternates user/assistant and rejects system messages.
EXPECT_RAISE = {("mistral", "system_multi"), ("mistral", "ends_with_assistant")}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return materialize_preset("tiny", cache=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def ours(tiny_folder) -> Tokenizer:
    return Tokenizer.from_folder(tiny_folder)


def load_template(name: str) -> str:
    return (DATA / f"{name}.jinja").read_text(encoding="utf-8")


_HF: dict[str, object] = {}


def hf_tokenizer(tiny_folder: Path, template_name: str):
    """transformers' fast tokenizer over the tiny tokenizer.json with this template."""
    if template_name not in _HF:
        from transformers import PreTrainedTokenizerFast

        _HF[template_name] = PreTrainedTokenizerFast(
            tokenizer_file=str(tiny_folder / "tokenizer.json"),
            bos_token=BOS,
            eos_token=EOS,
            chat_template=load_template(template_name),
        )
    return _HF[template_name]


def test_templates_are_real():
    for name in TEMPLATES:
        text = load_template(name)
        assert "messages" in text and "add_generation_prompt" in text or name == "mistral"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("template", TEMPLATES)
def test_matches_transformers(tiny_folder, ours, template, chat, add_generation_prompt):
    hf = hf_tokenizer(tiny_folder, template)
    messages = CHATS[chat]
    if (template, chat) in EXPECT_RAISE:
        with pytest.raises(Exception) as hf_err:
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        with pytest.raises(ChatTemplateError) as our_err:
            ours.apply_chat_template(messages, add_generation_prompt, chat_template=load_template(template))
        assert str(hf_err.value) in str(our_err.value)
        return
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(messages, add_generation_prompt, chat_template=load_template(template))
    assert got == expected
    assert isinstance(got, str) and got


@pytest.mark.parametrize("template", ["llama3_1", "qwen2_5"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tools_match_transformers(tiny_folder, ours, template, add_generation_prompt):
    hf = hf_tokenizer(tiny_folder, template)
    for messages in (CHATS["system_multi"], TOOL_CHAT):
        expected = hf.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = ours.apply_chat_template(
            messages, add_generation_prompt, chat_template=load_template(template), tools=TOOLS
        )
        assert got == expected
        assert "Zürich" in got  # tojson keeps non-ASCII text


def test_extra_kwargs_match_transformers(tiny_folder, ours):
    hf = hf_tokenizer(tiny_folder, "llama3_1")
    kwargs = {"date_string": "01 Jan 2030", "tools_in_user_message": False}
    expected = hf.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs)
    got = ours.apply_chat_template(TOOL_CHAT, chat_template=load_template("llama3_1"), tools=TOOLS, **kwargs)
    assert got == expected
    assert "Today Date: 01 Jan 2030" in got


def test_reasoning_aliases_match_transformers(tiny_folder, ours):
    from transformers import PreTrainedTokenizerFast

    template = (
        "{% for m in messages %}{{ m.role }}:{{ m | dictsort | map('first') | join(',') }}"
        "[{{ m.reasoning_content }}|{{ m.thinking }}]\n{% endfor %}"
    )
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tiny_folder / "tokenizer.json"), chat_template=template)
    chat = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "because"},
        {"role": "assistant", "content": "b", "thinking": "hmm", "tool_calls": None},
    ]
    expected = hf.apply_chat_template(chat, tokenize=False)
    assert ours.apply_chat_template(chat, False, chat_template=template) == expected
    assert "[because|because]" in expected


# ------------------------------------------------------------- environment


def render(template: str, **kwargs) -> str:
    return render_chat_template(template, [{"role": "user", "content": "x"}], **kwargs)


def test_tojson_like_transformers():
    value = {"b": "é <tag> & 'q'", "a": [1, 2.5, None, True]}
    assert render("{{ v | tojson }}", v=value) == json.dumps(value, ensure_ascii=False)
    assert render("{{ v | tojson(indent=2) }}", v=value) == json.dumps(value, ensure_ascii=False, indent=2)
    assert render("{{ v | tojson(sort_keys=true) }}", v=value) == json.dumps(value, ensure_ascii=False, sort_keys=True)


def test_strftime_now_and_raise_exception():
    year = str(datetime.datetime.now().year)
    assert render('{{ strftime_now("%Y") }}') in (year, str(int(year) + 1))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")


def test_trim_and_lstrip_blocks_and_loop_controls():
    template = (
        "{% for m in messages %}\n    {% if loop.index > 2 %}{% break %}{% endif %}\n[{{ m.content }}]\n{% endfor %}"
    )
    messages = [{"role": "user", "content": str(i)} for i in range(5)]
    assert render_chat_template(template, messages) == "[0]\n[1]\n"


def test_sandbox_blocks_mutation_and_internals():
    with pytest.raises(ChatTemplateError):
        render("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        render("{% set ns = namespace(_x=1) %}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        render("{% set ns = namespace(a=1) %}{% set ns._hidden = 2 %}")
    assert (
        render("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}")
        == "1"
    )
    assert render("{{ dict(a=1)['a'] }}") == "1"


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        render("{% if %}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat_template("{{ 'a' + messages[0].content }}", [{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_template(None, [{"role": "user", "content": "x"}])


def test_caller_messages_not_modified(ours):
    messages = [{"role": "user", "content": "hi", "name": None}]
    ours.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi", "name": None}]


# -------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "must be a list"),
        ({"role": "user", "content": "x"}, "must be a list"),
        (None, "must be a list"),
        ([], "empty"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "x"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "x"}, {"role": 3, "content": "x"}], r"messages\[1\]\['role'\]"),
        ([{"role": "user"}], r"messages\[0\] \(role 'user'\) has no 'content'"),
        ([{"role": "user", "content": None}], "has no 'content'"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\['content'\] must be a string"),
        ([{"role": "user", "content": ["text"]}], r"messages\[0\]\['content'\]\[0\]"),
    ],
)
def test_invalid_messages(ours, messages, match):
    with pytest.raises(ValueError, match=match):
        ours.apply_chat_template(messages)


def test_valid_message_shapes():
    out = validate_messages(
        (
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        )
    )
    assert out[1] == {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}


def test_bad_tools(ours):
    with pytest.raises(ValueError, match="tools"):
        ours.apply_chat_template(CHATS["single"], tools="get_weather")
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        ours.apply_chat_template(CHATS["single"], tools=["get_weather"])
