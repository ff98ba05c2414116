"""IncrementalDetokenizer: streamed text equals decode(), never splits a character."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from jaxserve.presets import materialize_preset
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = Path(__file__).resolve().parents[1] / "models" / "corpus.txt"
FFFD = "\ufffd"

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café, naïve, jalapeño, Ærøskøbing, Straße, façade — déjà vu.",
    "你好，世界。日本語のテキストと한국어 문장도 있습니다.",
    "Family 👩\u200d👩\u200d👧\u200d👦, flags 🇯🇵🇫🇷, rainbow 🏳\ufe0f\u200d🌈, thumbs 👍🏽 and 🧑🏿\u200d💻 coder.",
    "Mixed: Ελληνικά, русский, עברית, العربية, हिन्दी and ∑∫√∞ math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "Line one\nline two\n\n\tindented  double  spaces, trailing spaces   ",
    "🎉🎉🎉 Done! 100% ✔ 😀😃😄😁",
]


# ------------------------------------------------------------------ tokenizers


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    """The tiny preset's byte-level BPE (512 tokens: CJK/emoji split into bytes)."""
    folder = materialize_preset("tiny", cache=tmp_path_factory.mktemp("cache"))
    return Tokenizer.from_folder(folder)


def build_sentencepiece_style(vocab_size: int = 400) -> Tokenizer:
    """A Llama-2-like tokenizer: BPE with byte fallback, Metaspace pre-tokenizer,
    decoders Replace("▁", " ") / ByteFallback / Fuse / Strip. The small vocab is
    trained on ASCII-heavy text, so CJK, emoji and most accents fall back to
    <0xXX> byte tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
    trainer_tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=70,
        show_progress=False,
    )
    trainer_tok.train_from_iterator(lines, trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]

    # Final vocab, Llama 2 order: specials, the 256 byte tokens, then pieces.
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]

    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(tok, config={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    return build_sentencepiece_style()


@pytest.fixture(params=["byte_level", "sentencepiece"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def stream(tokenizer, ids, prompt_ids=None, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(t) for t in ids]
    tail = detok.flush()
    return detok, deltas, tail


# ----------------------------------------------------------------------- tests


def test_sentencepiece_fixture_uses_byte_fallback(sentencepiece):
    ids = sentencepiece.encode("你好 👍🏽", add_special_tokens=False)
    pieces = [sentencepiece.id_to_token(i) for i in ids]
    assert any(p.startswith("<0x") for p in pieces), pieces
    assert sentencepiece.encode("hi")[0] == 1  # BOS from the post-processor


def test_byte_level_fixture_splits_characters(byte_level):
    # A lone token of an emoji decodes to U+FFFD: the case the detokenizer guards against.
    ids = byte_level.encode("👩\u200d👩\u200d👧", add_special_tokens=False)
    assert any(FFFD in byte_level.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas, tail = stream(tokenizer, ids)
    assert tail == ""
    assert all(FFFD not in d for d in deltas), [d for d in deltas if FFFD in d]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text
    assert detok.num_tokens == len(ids)


def test_all_texts_in_one_stream(tokenizer):
    text = " ".join(TEXTS)
    ids = tokenizer.encode(text, add_special_tokens=True)
    _, deltas, tail = stream(tokenizer, ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text


def test_special_tokens_kept_or_skipped(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("你好 world") + [eos] + tokenizer.encode("again 👍🏽", add_special_tokens=False)
    for skip in (True, False):
        _, deltas, tail = stream(tokenizer, ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
        assert all(FFFD not in d for d in deltas)
    assert tokenizer.bos_token in tokenizer.decode(ids, skip_special_tokens=False)


def test_continuation_after_prompt(tokenizer):
    """Split one encoded text anywhere into prompt and generation: the stream
    equals what decoding the whole adds to decoding the prompt, leading space
    included (SentencePiece's "▁word" must come out as " word")."""
    text = "Answer: the café serves 你好 tea 👩\u200d👩\u200d👧 and cake, naïve ñandú."
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    checked = 0
    for k in range(1, len(ids)):
        prompt_text = tokenizer.decode(ids[:k])
        if FFFD in prompt_text or not full.startswith(prompt_text):
            continue  # split inside a character: no clean expectation
        _, deltas, tail = stream(tokenizer, ids[k:], prompt_ids=ids[:k])
        assert all(FFFD not in d for d in deltas), (k, deltas)
        assert "".join(deltas) + tail == full[len(prompt_text) :], k
        checked += 1
    assert checked > 10


def test_leading_space_after_prompt(sentencepiece):
    prompt = sentencepiece.encode("Say")
    gen = sentencepiece.encode("Say hello", add_special_tokens=False)[len(prompt) - 1 :]
    assert sentencepiece.id_to_token(gen[0]).startswith("▁")
    _, deltas, tail = stream(sentencepiece, gen, prompt_ids=prompt)
    assert "".join(deltas) + tail == " hello"
    # Without the prompt the first space is stripped, as decode() does.
    _, deltas, tail = stream(sentencepiece, gen)
    assert "".join(deltas) + tail == sentencepiece.decode(gen) == "hello"


def test_incomplete_tail_is_flushed(tokenizer):
    ids = tokenizer.encode("ok 👍🏽", add_special_tokens=False)[:-1]
    assert tokenizer.decode(ids).endswith(FFFD)
    detok, deltas, tail = stream(tokenizer, ids)
    assert all(FFFD not in d for d in deltas)
    assert tail.endswith(FFFD)
    # The complete emoji was emitted; the unfinished one comes out as U+FFFD.
    # (A byte-fallback decode() of the whole turns the entire byte run, the
    # complete 👍 included, into U+FFFD; the stream cannot take 👍 back.)
    assert detok.text.rstrip(FFFD) == "ok 👍"
    if tokenizer.id_to_token(ids[-1]).startswith("<0x"):
        assert len(detok.text) == len(tokenizer.decode(ids))
    else:
        assert detok.text == tokenizer.decode(ids)
    assert detok.flush() == ""


def test_random_streams_byte_level(byte_level):
    """Random ids (as from a random-weight model) form invalid UTF-8 often; the
    byte-level stream still reproduces decode() exactly."""
    rng = random.Random(1234)
    for _ in range(20):
        ids = [rng.randrange(byte_level.vocab_size) for _ in range(300)]
        _, deltas, tail = stream(byte_level, ids)
        assert "".join(deltas) + tail == byte_level.decode(ids)


def test_random_streams_byte_fallback(sentencepiece):
    """Random pieces mixed with random code points spelled as <0xXX> byte tokens
    (back to back, so byte runs hold several characters) match decode()."""
    rng = random.Random(99)
    pieces = [i for i in range(3, sentencepiece.vocab_size) if not sentencepiece.id_to_token(i).startswith("<0x")]
    ranges = [(0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFC), (0x10000, 0x10FFFF)]
    for _ in range(20):
        ids: list[int] = []
        while len(ids) < 300:
            if rng.random() < 0.5:
                ids.append(rng.choice(pieces))
            else:
                lo, hi = rng.choice(ranges)
                for b in chr(rng.randint(lo, hi)).encode("utf-8"):
                    ids.append(sentencepiece.token_to_id(f"<0x{b:02X}>"))
        _, deltas, tail = stream(sentencepiece, ids)
        assert all(FFFD not in d for d in deltas)
        assert tail == ""
        assert "".join(deltas) == sentencepiece.decode(ids)


def test_random_ids_byte_fallback_do_not_break(sentencepiece):
    """Arbitrary ids: a byte-fallback decode() garbles a whole byte run once any
    byte in it is invalid, while the stream has already shown the valid
    characters before it; the text agrees wherever decode() has no U+FFFD."""
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(sentencepiece.vocab_size) for _ in range(300)]
        detok, deltas, tail = stream(sentencepiece, ids)
        expected = sentencepiece.decode(ids)
        if FFFD not in expected:
            assert detok.text == expected
        assert detok.flush() == ""


def test_window_stays_bounded(tokenizer):
    """O(1) work per token: the decoded window never grows with the stream,
    not even for a model stuck repeating a lone lead byte."""
    text = " ".join(TEXTS)
    ids = tokenizer.encode(text, add_special_tokens=False) * 20
    lead = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == FFFD][0]
    # The text piece between the runs of bad bytes ends on a whole character:
    # a piece ending inside one (a lone 0xC3, say) would pair with the next
    # run's byte into a valid character that decode() (which rejects a whole
    # run of byte tokens at once) and an incremental reader legitimately
    # disagree on. Which piece that is depends on the trained vocabulary.
    k = max(n for n in range(1, 41) if not tokenizer.decode(ids[:n]).endswith(FFFD))
    for stream_ids in (ids, [lead] * 2000, ([lead] * 7 + ids[:k]) * 30):
        detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:50])
        biggest = 0
        for t in stream_ids:
            detok.push(t)
            biggest = max(biggest, detok.window_size)
        detok.flush()
        assert biggest <= 40
        assert detok.text == tokenizer.decode(ids[:50] + stream_ids)[len(tokenizer.decode(ids[:50])) :]


def test_runs_of_special_tokens(tokenizer):
    """Long runs of skipped special tokens (random-weight models emit plenty)
    leave the window alone and the text equal to decode()."""
    eos, bos = tokenizer.eos_token_ids[0], tokenizer.bos_token_id
    word = tokenizer.encode("Hello", add_special_tokens=False)
    rest = tokenizer.encode("Hello world 你好", add_special_tokens=False)[len(word) :]
    ids = word + [eos, bos] * 100 + rest
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        biggest = 0
        for t in ids:
            detok.push(t)
            biggest = max(biggest, detok.window_size)
        detok.flush()
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
        assert biggest <= (len(word) + len(rest) if skip else 40)
    assert detok.num_tokens == len(ids)


def test_bare_tokenizers_object(tokenizer):
    ids = tokenizer.encode(TEXTS[3])
    ours = stream(tokenizer, ids)[1]
    bare = stream(tokenizer.backend, ids)[1]
    assert ours == bare
