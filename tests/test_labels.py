"""Label prompts (jaxserve.tokenizer.labels) and the job fields that ask for
them: the chat form, labels tokenized with the text they follow (a merge
across the boundary moves it back), few-shot turns, the content-free input of
calibration, 'first' normalization; the engine's label log-likelihoods equal
transformers' on the same prompts for the chat, plain, few-shot and
calibrated forms; validation at the door; ``jaxserve batch`` flags; and a
chat-form calibrated job through the real broker, its calibration computed
once for every job that shares it."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from jaxserve.engine import scoring
from jaxserve.request_error import RequestError
from jaxserve.tokenizer import labels as L
from jaxserve.wire.job import JobProperties, parse_job
from queue_support import ByteTokenizer, EchoEngine

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tok():
    from jaxserve.presets import resolve_model
    from jaxserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_folder(resolve_model("tiny"))


def toks(tok, ids):
    return [tok.id_to_token(i) for i in ids]


# ------------------------------------------------------------ the module


def test_chat_form_scores_each_label_as_the_assistants_answer(tok):
    req = L.LabelRequest(labels=("sports", "business"), prompt="Doc: the match ended 2-1", form="chat")
    t = L.prepare(tok, req)
    assert t.prompt_ids == tok.encode_chat([{"role": "user", "content": "Doc: the match ended 2-1"}])
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Doc: the match ended 2-1"}], add_generation_prompt=True
    )
    for label, ids in zip(req.labels, t.label_ids):
        assert t.prompt_ids + ids == tok.encode(rendered + label, add_special_tokens=False)
        assert tok.decode(ids) == label


def test_a_merge_across_the_boundary_moves_it_back(tok):
    # "is " + "sports" is written "is", " sports": the label is scored as the
    # model writes it, not as "sports" glued after a lone space token
    t = L.prepare(tok, L.LabelRequest(labels=("sports", "business"), prompt="The topic is ", form="plain"))
    assert t.prompt_ids == tok.encode("The topic is")
    assert t.label_ids == [
        tok.encode(" sports", add_special_tokens=False),
        tok.encode(" business", add_special_tokens=False),
    ]
    # without the trailing space the label follows the prompt's last character, as given
    glued = L.prepare(tok, L.LabelRequest(labels=("sports", "business"), prompt="The topic is:", form="plain"))
    assert glued.prompt_ids == tok.encode("The topic is:") and toks(tok, glued.label_ids[0])[0] == "s"


def test_few_shot_turns_go_after_the_system_message(tok):
    shots = (L.FewShot("a late goal won it", "sports"), L.FewShot("shares fell 3%", "business"))
    msgs = ({"role": "system", "content": "Classify."}, {"role": "user", "content": "the senate voted"})
    req = L.LabelRequest(labels=("sports", "business"), messages=msgs, form="chat", few_shot=shots)
    assert [(m["role"], m["content"]) for m in L.chat_messages(req)] == [
        ("system", "Classify."),
        ("user", "a late goal won it"),
        ("assistant", "sports"),
        ("user", "shares fell 3%"),
        ("assistant", "business"),
        ("user", "the senate voted"),
    ]
    plain = L.render(
        tok, L.LabelRequest(labels=("sports", "business"), prompt="Topic of: rates rose. Topic:", few_shot=shots)
    )
    assert plain == ("a late goal won itsports\n\nshares fell 3%business\n\nTopic of: rates rose. Topic:", True)


def test_first_token_only_and_labels_that_would_tie(tok):
    t = L.prepare(tok, L.LabelRequest(labels=(" sports", " business"), prompt="The topic is", first_token_only=True))
    assert [len(x) for x in t.label_ids] == [1, 1]
    with pytest.raises(L.LabelPromptError, match="'first' cannot tell ' sports' from ' sportsman'"):
        L.prepare(tok, L.LabelRequest(labels=(" sports", " sportsman"), prompt="The topic is", first_token_only=True))


def test_content_free_input_replaces_the_document(tok):
    req = L.LabelRequest(labels=("a", "b"), prompt="Classify: the long document")
    assert req.content_free().prompt == "N/A" and req.content_free("--").prompt == "--"
    msgs = (
        {"role": "system", "content": "s"},
        {"role": "user", "content": "doc"},
        {"role": "assistant", "content": "x"},
    )
    cf = L.LabelRequest(labels=("a", "b"), messages=msgs, form="chat").content_free()
    assert [m["content"] for m in cf.messages] == ["s", "N/A", "x"] and msgs[1]["content"] == "doc"
    with pytest.raises(L.LabelPromptError, match="no user message"):
        L.LabelRequest(labels=("a", "b"), messages=({"role": "system", "content": "s"},), form="chat").content_free()
    # the same labels and template give the same calibration key, whatever the document
    a = L.prepare(tok, L.LabelRequest(labels=("x", "y"), prompt="doc one", form="chat").content_free())
    b = L.prepare(tok, L.LabelRequest(labels=("x", "y"), prompt="another doc", form="chat").content_free())
    assert (
        a.identity()
        == b.identity()
        != L.prepare(tok, L.LabelRequest(labels=("x", "z"), prompt="d", form="chat").content_free()).identity()
    )


def test_plain_form_refuses_messages(tok):
    with pytest.raises(L.LabelPromptError, match="label_prompt: 'plain'"):
        L.prepare(tok, L.LabelRequest(labels=("a", "b"), messages=({"role": "user", "content": "x"},), form="plain"))


def test_calibrated_combine_ranks_by_score_minus_offset():
    scored = scoring.combine(["a", "b", "c"], [-1.0, -2.0, -3.0], [1, 2, 1], "sum", offsets=[-0.5, -3.0, -1.0])
    assert [s.logprob for s in scored] == [-1.0, -2.0, -3.0]  # the label's own logprob is kept
    want = np.exp([-0.5, 1.0, -2.0]) / np.exp([-0.5, 1.0, -2.0]).sum()
    np.testing.assert_allclose([s.prob for s in scored], want, rtol=1e-12)
    assert scoring.best(scored).label == "b"  # the uncalibrated winner would be "a"
    mean = scoring.combine(
        ["a", "b"], [-1.0, -4.0], [1, 2], "mean", offsets=scoring.normalize([-1.0, -2.0], [1, 2], "mean")
    )
    assert [s.score for s in mean] == [0.0, -1.0]


# ------------------------------------------------------- validation at the door


def job(**body):
    return parse_job(orjson.dumps(body), JobProperties(message_id="k1"))


@pytest.mark.parametrize(
    "body, needle",
    [
        (
            {"prompt": "x", "labels": ["a", "b"], "label_prompt": "xml"},
            "label_prompt: Input should be 'plain' or 'chat' (got 'xml')",
        ),
        (
            {"prompt": "x", "labels": ["a", "b"], "label_normalization": "max"},
            "label_normalization: Input should be 'sum', 'mean' or 'first' (got 'max')",
        ),
        (
            {"prompt": "x", "labels": ["a", "b"], "few_shot": [{"text": "t", "label": "c"}]},
            "few_shot[0].label 'c' is not one of the job's labels",
        ),
        ({"prompt": "x", "labels": ["a", "b"], "few_shot": [{"text": "", "label": "a"}]}, "few_shot[0].text"),
        (
            {"prompt": "x", "label_prompt": "chat"},
            "label_prompt is for label scoring and needs labels, got label_prompt='chat'",
        ),
        ({"prompt": "x", "calibrate": True}, "calibrate is for label scoring and needs labels"),
        (
            {"prompt": "x", "labels": ["a", "b"], "calibration_input": "N/A"},
            "calibration_input is used with calibrate: true",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "labels": ["a", "b"], "label_prompt": "plain"},
            "label_prompt 'plain' continues a prompt",
        ),
        (
            {"prompt": "x", "labels": ["a", "b"], "calibrate": "yes"},
            "calibrate: Input should be a valid boolean (got 'yes')",
        ),
    ],
)
def test_bad_label_fields_are_refused_naming_field_and_value(body, needle):
    with pytest.raises(RequestError) as err:
        job(**body)
    assert err.value.code == "invalid_request" and needle in err.value.message, err.value.message


def test_label_fields_reach_the_job_and_its_fingerprint():
    plain = job(prompt="x", labels=["a", "b"])
    assert (plain.label_prompt, plain.calibrate, plain.few_shot, plain.label_normalization) == (
        "plain",
        False,
        (),
        "sum",
    )
    assert (
        job(messages=[{"role": "user", "content": "x"}], labels=["a", "b"]).label_prompt == "chat"
    )  # as before the field
    chat = job(
        prompt="x",
        labels=["a", "b"],
        label_prompt="chat",
        calibrate=True,
        calibration_input="-",
        label_normalization="first",
        few_shot=[{"text": "t", "label": "b"}],
    )
    assert (chat.label_prompt, chat.calibrate, chat.calibration_input, chat.few_shot) == (
        "chat",
        True,
        "-",
        (("t", "b"),),
    )
    assert (
        len({plain.fingerprint, chat.fingerprint, job(prompt="x", labels=["a", "b"], label_prompt="chat").fingerprint})
        == 3
    )


# --------------------------------------------- the engine against transformers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from engine_fixtures import build_engine_checkpoint

    return build_engine_checkpoint(tmp_path_factory.mktemp("labels_ck"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.engine import Engine

    eng = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=8,
            max_num_batched_tokens=128,
            max_model_len=256,
            block_size=16,
            enable_prefix_caching=False,
            seed=0,
        )
    )  # (as test_engine_scoring: few programs to compile)
    eng.warmup()
    return eng


def engine_logprobs(eng, t: L.LabelTokens, rid: str) -> list[float]:
    eng.add_score_request(rid, t.prompt_ids, t.label_ids)
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished and out.request_id == rid:
                assert out.error is None
                return list(out.label_logprobs)
    raise AssertionError("no output")


def hf_logprobs(hf, hf_tok, text: str, labels, add_special_tokens: bool) -> list[float]:
    """transformers on its own tokenization of prompt + label (its own chat
    template rendering for the chat form)."""
    prompt = hf_tok(text, add_special_tokens=add_special_tokens).input_ids
    out = []
    for label in labels:
        full = hf_tok(text + label, add_special_tokens=add_special_tokens).input_ids
        n = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), -1)
        out.append(sum(float(lp[j - 1, full[j]]) for j in range(n, len(full))))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("form", ["chat", "plain", "few-shot", "calibrated"])
def test_label_logprobs_equal_transformers(engine, checkpoint, form):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(checkpoint)
    labels = ("sports", "business news", "science")
    doc = "The striker scored twice as the home side won 3-1."
    shots = (L.FewShot("Shares rose 4% after the results.", "business news"),) if form == "few-shot" else ()
    if form == "plain":
        req = L.LabelRequest(labels=labels, prompt=f"Article: {doc}\nTopic: ", form="plain")
    else:
        req = L.LabelRequest(labels=labels, prompt=f"Topic of this article? {doc}", form="chat", few_shot=shots)
    requests = [req, req.content_free()] if form == "calibrated" else [req]
    got_all, want_all = [], []
    for i, r in enumerate(requests):
        t = L.prepare(engine.tokenizer, r)
        got = engine_logprobs(engine, t, f"{form}-{i}")
        if r.form == "chat":
            msgs = L.chat_messages(r)
            text, specials = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), False
            assert text == L.render(engine.tokenizer, r)[0]
        else:
            text, specials = r.prompt, True
        want = hf_logprobs(hf, hf_tok, text, labels, specials)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        got_all.append(got)
        want_all.append(want)
    if form == "calibrated":
        counts = [1] * len(labels)
        ours = scoring.combine(labels, got_all[0], counts, offsets=got_all[1])
        ref = np.array(want_all[0]) - np.array(want_all[1])
        np.testing.assert_allclose(
            [s.prob for s in ours], np.exp(ref - ref.max()) / np.exp(ref - ref.max()).sum(), rtol=1e-4
        )
    if form == "plain":
        # "Topic: " + "sports": the space belongs to the label's first token
        assert L.prepare(engine.tokenizer, req).prompt_ids == engine.tokenizer.encode(f"Article: {doc}\nTopic:")


# ------------------------------------------------------------ jaxserve batch


def test_batch_label_defaults_and_flags(tmp_path):
    import click

    from jaxserve.batch.inputs import InputError, InputOptions, read_items
    from jaxserve.cli.batch_command import DEFAULT_CALIBRATE, DEFAULT_LABEL_PROMPT, _label_defaults

    shots = tmp_path / "shots.jsonl"
    shots.write_text('{"text": "a goal", "label": "sports"}\n{"text": "rates rose", "label": "business"}\n')
    template = "Topic? {{ text }}"
    d = _label_defaults(["sports", "business"], template, False, None, None, None, None, str(shots))
    assert d["label_prompt"] == DEFAULT_LABEL_PROMPT == "chat" and DEFAULT_CALIBRATE
    assert d["calibrate"] is True and d["calibration_input"] == "Topic? N/A"
    assert d["few_shot"] == [
        {"text": "Topic? a goal", "label": "sports"},
        {"text": "Topic? rates rose", "label": "business"},
    ]
    off = _label_defaults(["sports", "business"], None, False, "plain", "first", False, None, None)
    assert off == {"label_prompt": "plain", "label_normalization": "first"}
    with pytest.raises(click.BadParameter, match="--chat"):
        _label_defaults(["a", "b"], None, True, "plain", None, None, None, None)
    with pytest.raises(InputError, match="'music' is not one of --labels"):
        (tmp_path / "bad.jsonl").write_text('{"text": "a song", "label": "music"}\n')
        _label_defaults(["sports", "business"], None, False, None, None, None, None, str(tmp_path / "bad.jsonl"))
    # label defaults go to labelled lines only; a chat line is scored in the chat form
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(
        b'{"id": "p", "prompt": "x"}\n{"id": "m", "messages": [{"role": "user", "content": "y"}]}\n'
        b'{"id": "g", "prompt": "z", "labels": null}\n'
    )
    _, items = read_items(inp, InputOptions(labels=["a", "b"], label_defaults=off))
    assert items[0].body == {
        "prompt": "x",
        "labels": ["a", "b"],
        "label_prompt": "plain",
        "label_normalization": "first",
    }
    assert items[1].body["label_prompt"] == "chat"
    assert "label_prompt" not in items[2].body


def test_batch_cli_reports_a_bad_few_shot_file_before_the_broker(tmp_path):
    from click.testing import CliRunner

    from jaxserve.cli.batch_command import batch

    inp = tmp_path / "docs.jsonl"
    inp.write_text('{"id": "1", "text": "a goal"}\n')
    (tmp_path / "shots.jsonl").write_text('{"text": "x"}\n')
    res = CliRunner().invoke(
        batch,
        [
            str(inp),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--labels",
            "a,b",
            "--template",
            "{{ text }}",
            "--few-shot",
            str(tmp_path / "shots.jsonl"),
            "--amqp-url",
            "amqp://guest:guest@127.0.0.1:1/",
        ],
    )
    assert res.exit_code == 1 and "needs a string 'label' field" in res.output, res.output


# -------------------------------------------------------- through the broker


async def test_chat_calibrated_jobs_through_the_queue_share_one_calibration(harness, prefix, client):
    w = await harness.start(EchoEngine(step_s=0.001))
    labels = ["sports", "politics"]
    docs = ["the sports match", "a vote in the senate", "spots"]
    results = await asyncio.gather(
        *[client.submit(d, labels=labels, label_prompt="chat", calibrate=True, queue="batch", timeout=60) for d in docs]
    )
    assert w.calibrations.computed == 1 and len(w.calibrations) == 1
    tok = ByteTokenizer()

    def echo_scores(prompt_text: str) -> list[float]:  # EchoEngine's score of each label after a prompt
        seen = set(tok.encode(prompt_text))
        return [-0.1 * len(x) - 0.5 * sum(1 for t in tok.encode(x) if t not in seen) for x in labels]

    offsets = echo_scores(tok.apply_chat_template([{"role": "user", "content": "N/A"}]))
    for doc, r in zip(docs, results):
        assert r.ok, r.error
        own = echo_scores(tok.apply_chat_template([{"role": "user", "content": doc}]))
        assert [x.logprob for x in r.labels] == pytest.approx(own)
        z = [a - b for a, b in zip(own, offsets)]
        want = [math.exp(v - max(z)) / sum(math.exp(u - max(z)) for u in z) for v in z]
        assert [x.prob for x in r.labels] == pytest.approx(want) and r.text == labels[int(np.argmax(z))]
    bad = await client.submit("x", labels=labels, few_shot=[{"text": "t", "label": "music"}], timeout=30)
    assert bad.error.code == "invalid_request" and "few_shot[0].label 'music'" in bad.error.message
