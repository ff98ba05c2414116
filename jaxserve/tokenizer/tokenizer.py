"""Tokenizer loading on top of the Hugging Face ``tokenizers`` library.

A model folder holds ``tokenizer.json`` (required) plus optional
``tokenizer_config.json``, ``chat_template.jinja``,
``additional_chat_templates/*.jinja``, ``generation_config.json`` and
``config.json``. Encoding follows ``tokenizer.json`` exactly: whether a BOS
token is prepended is decided by its post-processor, never by this class.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from jaxserve.json_files import read_json_object
from jaxserve.tokenizer.chat_template import ChatTemplateError, fold_system_message, render_chat_template

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# Named special tokens that transformers exposes to chat templates.
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerLoadError(ValueError):
    """A tokenizer folder is missing files or holds malformed ones."""


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config: a string, or a dict with "content"."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    return read_json_object(path, TokenizerLoadError)


def _id_list(value: Any) -> list[int]:
    """eos_token_id fields may be an int, a list of ints, or null."""
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _load_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Templates by name, following transformers' precedence.

    Standalone files (``chat_template.jinja`` as "default", plus
    ``additional_chat_templates/NAME.jinja``) win over anything in
    tokenizer_config; otherwise tokenizer_config's ``chat_template`` is either
    one string (named "default") or a list of ``{"name", "template"}``.
    """
    templates: dict[str, str] = {}
    single = folder / CHAT_TEMPLATE_FILE
    if single.is_file():
        templates["default"] = single.read_text(encoding="utf-8")
    extra_dir = folder / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name[: -len(".jinja")]] = path.read_text(encoding="utf-8")
    if templates:
        return templates

    raw = config.get("chat_template")
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        for i, entry in enumerate(raw):
            if (
                not isinstance(entry, Mapping)
                or not isinstance(entry.get("name"), str)
                or not isinstance(entry.get("template"), str)
            ):
                raise TokenizerLoadError(
                    f'{folder / TOKENIZER_CONFIG_FILE}: chat_template[{i}] must be {{"name": str, "template": str}}'
                )
            templates[entry["name"]] = entry["template"]
        return templates
    if isinstance(raw, Mapping):
        # Not a format transformers writes, but harmless to accept.
        return {str(k): v for k, v in raw.items() if isinstance(v, str)}
    raise TokenizerLoadError(
        f"{folder / TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list, got {type(raw).__name__}"
    )


class Tokenizer:
    """A loaded tokenizer plus the metadata serving needs (BOS/EOS, chat templates)."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        config: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        path: Path | None = None,
        fold_system: bool = False,
    ) -> None:
        self._tok = tokenizer
        #: a leading system message the template refuses is folded into the
        #: first user message (:meth:`apply_chat_template`): the model's family
        #: has no system role (``jaxserve.models.family.Family.fold_system``)
        self.fold_system = fold_system
        self._config: dict[str, Any] = dict(config or {})
        self._chat_templates: dict[str, str] = dict(chat_templates or {})
        self.path = path

        self._special_tokens: dict[str, str] = {}
        for attr in _NAMED_SPECIAL_TOKENS:
            content = _token_content(self._config.get(attr))
            if content is not None:
                self._special_tokens[attr] = content

        self._bos_token_id = self._lookup(self._special_tokens.get("bos_token"))
        eos_ids: list[int] = []
        eos_id = self._lookup(self._special_tokens.get("eos_token"))
        if eos_id is not None:
            eos_ids.append(eos_id)
        for token_id in extra_eos_token_ids:
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        self._eos_token_ids = tuple(eos_ids)
        self._all_special_ids = frozenset(
            token_id for token_id, added in self._tok.get_added_tokens_decoder().items() if added.special
        )

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str], *, fold_system: bool = False) -> Tokenizer:
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            if not folder.exists():
                raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {folder} (expected {tokenizer_file}); only fast "
                "tokenizers serialized as tokenizer.json are supported"
            )
        try:
            hf_tokenizer = _HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerLoadError(f"cannot load {tokenizer_file}: {exc}") from exc

        config = _read_json(folder / TOKENIZER_CONFIG_FILE) or {}
        chat_templates = _load_chat_templates(folder, config)

        extra_eos: list[int] = []
        for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
            data = _read_json(folder / name)
            if data is not None:
                extra_eos.extend(_id_list(data.get("eos_token_id")))

        return cls(
            hf_tokenizer,
            config=config,
            chat_templates=chat_templates,
            extra_eos_token_ids=extra_eos,
            path=folder,
            fold_system=fold_system,
        )

    # ------------------------------------------------------------ encode/decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; BOS/EOS come only from tokenizer.json's post-processor."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # --------------------------------------------------------------- metadata

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """tokenizer_config's eos_token first, then generation_config/config eos ids, deduplicated."""
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._all_special_ids

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def model_max_length(self) -> int | None:
        value = self._config.get("model_max_length")
        # transformers writes a huge sentinel (int(1e30)) when unknown.
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10**12:
            return value
        return None

    @property
    def chat_template(self) -> str | None:
        """The default chat template (or the only one), None when the folder has none."""
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if len(self._chat_templates) == 1:
            return next(iter(self._chat_templates.values()))
        return None

    @property
    def chat_templates(self) -> dict[str, str]:
        return dict(self._chat_templates)

    # ------------------------------------------------------------ chat template

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """Pick a template: a name among this folder's templates, literal template text,
        or (None) the folder's "tool_use" template when tools are given, else its default."""
        if chat_template is not None:
            if chat_template in self._chat_templates:
                return self._chat_templates[chat_template]
            return chat_template
        if not self._chat_templates:
            where = f" in {self.path}" if self.path is not None else ""
            raise ChatTemplateError(
                f"no chat template{where}: tokenizer_config.json has no chat_template and there is "
                f"no {CHAT_TEMPLATE_FILE}; pass chat_template= or use a plain prompt"
            )
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        template = self.chat_template
        if template is None:
            raise ChatTemplateError(
                "this tokenizer has several chat templates and none is named 'default'; pass "
                f"chat_template= one of {sorted(self._chat_templates)}"
            )
        return template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` the way transformers' ``apply_chat_template(tokenize=False)`` does.

        The named special tokens of tokenizer_config (bos_token, eos_token, ...)
        are template variables; ``kwargs`` are passed too and override them.

        With :attr:`fold_system`, messages that begin with a system message
        which the template refuses are rendered again with it folded into
        the first user message (:func:`fold_system_message`); a template
        that takes them renders them as they are, exactly as transformers.
        """
        template = self.get_chat_template(chat_template, tools)
        variables: dict[str, Any] = dict(self._special_tokens)
        variables.update(kwargs)

        def render(chat: Sequence[Mapping[str, Any]]) -> str:
            return render_chat_template(
                template,
                chat,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                **variables,
            )

        try:
            return render(messages)
        except ChatTemplateError:
            folded = fold_system_message(messages) if self.fold_system else None
            if folded is None:
                raise
        return render(folded)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Render then encode without post-processor specials: the template writes
        its own BOS, as in transformers' and vLLM's chat paths."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"bos_token_id={self.bos_token_id}, eos_token_ids={self.eos_token_ids})"
        )
