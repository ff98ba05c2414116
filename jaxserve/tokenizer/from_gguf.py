"""Build a Hugging Face ``tokenizers`` tokenizer from a GGUF file's metadata.

A GGUF file carries no ``tokenizer.json``: llama.cpp stores the vocabulary
(``tokenizer.ggml.tokens``, ``.scores``, ``.token_type``, ``.merges``), the
special token ids, the add-BOS/add-EOS rules and a pre-tokenizer name
(``tokenizer.ggml.pre``) as metadata. :func:`tokenizer_from_gguf` turns them
into the ``tokenizer.json`` / ``tokenizer_config.json`` pair that
:class:`jaxserve.tokenizer.Tokenizer` reads, so a GGUF model tokenizes
through the same code as any Hugging Face folder.

Two vocabulary kinds (``tokenizer.ggml.model``):

``gpt2``
    byte-level BPE: the tokens are spelled in GPT-2's byte alphabet and the
    file lists the merges. The pre-tokenizer (how text is split before the
    merges apply) is named by ``tokenizer.ggml.pre``; the split patterns are
    llama.cpp's for each name (:data:`PRE_TOKENIZERS`). An unknown name is
    refused rather than guessed: a wrong split gives plausible but different
    ids.
``llama``
    SentencePiece-style BPE: ``▁`` for spaces, ``<0xAB>`` byte tokens as the
    fallback for unknown characters, merges chosen by the score of the merged
    piece. Files converted from a SentencePiece model list no merges; they are
    rebuilt from the scores (:func:`merges_from_scores`), highest score first,
    the order llama.cpp's tokenizer merges in.

Tokens typed CONTROL (3) become special added tokens (matched whole in the
text, dropped by ``decode(skip_special_tokens=True)``), USER_DEFINED (4)
plain added tokens; the BOS/EOS/UNK/PAD tokens are special too. The result
is compared with transformers' own GGUF tokenizer in tests/test_gguf.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

from jaxserve.tokenizer.tokenizer import TokenizerLoadError

# llama.cpp's token types (llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` -> (split kind, extra settings). "gpt2": GPT-2's own
#: regex; "digits+gpt2": every digit alone, then GPT-2's regex (StarCoder's and
#: SmolLM's tokenizers); "regex": the given pattern, then the byte mapping.
PRE_TOKENIZERS: dict[str, tuple[str, str | None]] = {
    "default": ("gpt2", None),
    "gpt2": ("gpt2", None),
    "gpt-2": ("gpt2", None),
    "smollm": ("digits+gpt2", None),
    "starcoder": ("digits+gpt2", None),
    "refact": ("digits+gpt2", None),
    "codeshell": ("digits+gpt2", None),
    "llama-bpe": ("regex", _LLAMA3_SPLIT),
    "llama3": ("regex", _LLAMA3_SPLIT),
    "llama-v3": ("regex", _LLAMA3_SPLIT),
    "smaug-bpe": ("regex", _LLAMA3_SPLIT),
    "qwen2": ("regex", _QWEN2_SPLIT),
    "deepseek-r1-qwen": ("regex", _QWEN2_SPLIT),
}
# pre-tokenizers whose vocabulary takes a whole pre-token found in it without
# merging (llama.cpp's ``ignore_merges``; Llama 3's tokenizer.json says the same)
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe"})


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """What a model folder needs: ``tokenizer`` (saved as tokenizer.json),
    ``tokenizer_config`` (tokenizer_config.json: special token names, the
    add-BOS/EOS rules, the chat template) and the ids that end generation."""

    tokenizer: Any
    tokenizer_config: dict[str, Any]
    bos_token_id: int | None
    eos_token_id: int | None
    generation_eos_ids: tuple[int, ...]


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    spelling = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens of the vocabulary, ranked
    by the score of the token they make (highest first; SentencePiece scores
    are log-probabilities, so the likeliest piece merges first). Equal
    scores rank the longer left piece, then the longer right piece first;
    the splits of one token go in the ids' order of their pieces."""
    ids: dict[str, int] = {}
    for index, token in enumerate(tokens):
        ids[token] = index
    candidates: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores):
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                local.append((ids[left], ids[right], left, right))
        local.sort()
        candidates.extend((float(score), len(l), len(r), l, r) for _, _, l, r in local)
    # a stable sort on the key, descending, keeps equal keys in the order above
    candidates.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)
    return [(l, r) for _, _, _, l, r in candidates]


def _token_name(tokens: Sequence[str], metadata: Mapping[str, Any], key: str) -> tuple[int | None, str | None]:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None, None
    index = int(value)
    if not 0 <= index < len(tokens):
        raise TokenizerLoadError(f"tokenizer.ggml.{key}={index} is outside the vocabulary of {len(tokens)} tokens")
    return index, tokens[index]


def tokenizer_from_gguf(metadata: Mapping[str, Any], source: str = "GGUF file") -> GGUFTokenizer:
    """The tokenizer a GGUF file describes (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerLoadError(f"{source}: GGUF metadata has no tokenizer.ggml.tokens")
    tokens = [str(t) for t in tokens]
    types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerLoadError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    merges_raw = metadata.get("tokenizer.ggml.merges")
    pre = metadata.get("tokenizer.ggml.pre")

    if kind == "gpt2":
        pre_name = pre or "default"
        if pre_name not in PRE_TOKENIZERS:
            raise TokenizerLoadError(
                f"{source}: unsupported tokenizer.ggml.pre {pre_name!r}; supported: {', '.join(PRE_TOKENIZERS)}"
            )
        spelling = _byte_alphabet()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for index, (token, ttype) in enumerate(zip(tokens, types)):
            if ttype in (TOKEN_CONTROL, TOKEN_USER_DEFINED) or set(token) <= alphabet:
                vocab.setdefault(token, index)
            else:  # a normal token stored as text: spell its bytes
                vocab.setdefault("".join(spelling[b] for b in token.encode("utf-8")), index)
        if merges_raw is None:
            raise TokenizerLoadError(f"{source}: a 'gpt2' vocabulary needs tokenizer.ggml.merges")
        merges = [_split_merge(m, source) for m in merges_raw]
        model = models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre_name in _IGNORE_MERGES,
        )
        tok = Tokenizer(model)
        split, pattern = PRE_TOKENIZERS[pre_name]
        if split == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif split == "digits+gpt2":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(cast(str, pattern)), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        default_add_bos = pre_name in _IGNORE_MERGES
    elif kind == "llama":
        vocab = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(token, index)
        if merges_raw is not None:
            merges = [_split_merge(m, source) for m in merges_raw]
        else:
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise TokenizerLoadError(
                    f"{source}: a 'llama' vocabulary without tokenizer.ggml.merges needs one "
                    "tokenizer.ggml.scores entry per token"
                )
            merges = merges_from_scores(tokens, scores)
        _, unk = _token_name(tokens, metadata, "unknown_token_id")
        if unk is None and "<unk>" in vocab:
            unk = "<unk>"
        model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        tok = Tokenizer(model)
        prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False
        )
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix_space:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(steps)
        default_add_bos = True
    else:
        raise TokenizerLoadError(
            f"{source}: unsupported tokenizer.ggml.model {kind!r}; supported: gpt2 (byte-level BPE), "
            "llama (SentencePiece-style BPE)"
        )

    bos_id, bos = _token_name(tokens, metadata, "bos_token_id")
    eos_id, eos = _token_name(tokens, metadata, "eos_token_id")
    _, unk_name = _token_name(tokens, metadata, "unknown_token_id")
    _, pad = _token_name(tokens, metadata, "padding_token_id")

    special: list[str] = []
    for token, ttype in zip(tokens, types):
        if ttype == TOKEN_CONTROL and token not in special:
            special.append(token)
    for token in (unk_name if kind == "llama" else None, bos, eos, pad):
        if token is not None and token not in special:
            special.append(token)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, ttype in zip(tokens, types) if ttype == TOKEN_USER_DEFINED and t not in special]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    if tok.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise TokenizerLoadError(
            f"{source}: the tokenizer came out with {tok.get_vocab_size(with_added_tokens=True)} tokens, "
            f"expected {len(vocab)}"
        )

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    used: dict[str, int] = {}
    # add_bos/add_eos imply the token exists (so its name and id are set)
    if add_bos and bos is not None and bos_id is not None:
        used[bos] = bos_id
    if add_eos and eos is not None and eos_id is not None:
        used[eos] = eos_id
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(used.items()))

    config: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for name, value in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk_name), ("pad_token", pad)):
        if value is not None:
            config[name] = value
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template

    stop: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in stop:
            stop.append(int(value))
    return GGUFTokenizer(
        tokenizer=tok,
        tokenizer_config=config,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        generation_eos_ids=tuple(stop),
    )


def _split_merge(merge: str, source: str) -> tuple[str, str]:
    left, sep, right = str(merge).partition(" ")
    if not sep or not left or not right:
        raise TokenizerLoadError(f"{source}: malformed tokenizer.ggml.merges entry {merge!r}")
    return left, right


__all__ = ["GGUFTokenizer", "PRE_TOKENIZERS", "merges_from_scores", "tokenizer_from_gguf"]
