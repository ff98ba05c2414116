"""Input files of ``jaxserve batch`` as a list of :class:`BatchItem`.

Three kinds of line or row:

* an OpenAI Batch line ``{"custom_id", "method", "url", "body"}`` for
  ``/v1/completions`` or ``/v1/chat/completions`` (any other ``url`` is an
  error line for that request);
* a jaxserve job body (``prompt`` or ``messages`` ...), its id from ``id``,
  ``message_id`` or ``custom_id`` when present;
* a table row (CSV, Parquet, or JSONL with ``--template``): the prompt is
  the template rendered with the row's fields (jinja2), the id from
  ``--id-column``.

Keys are scoped to the file and name the job: ``<batch id>:<custom_id>:<job
digest>`` (``jaxserve.batch.keys.job_key``), where the batch id is a hash of
the file's content (or ``--batch-id``), so two files that both say
``request-1`` never share a result, and the digest covers what the body asks
for, so the same file run with other options is a new run; a row without an
id gets one from its content. Lines that cannot be used become items with an
``error`` (their line number and what is wrong) instead of stopping the run.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from jaxserve.batch.keys import job_key

#: looked up with a line's "url" as given, whatever its type
ENDPOINTS: dict[Any, str] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
# Body fields an OpenAI endpoint accepts that jaxserve cannot honour: refused
# per request rather than silently ignored.
# (logprobs, top_logprobs and response_format are honoured: the worker checks them.)
_UNSUPPORTED = ("tools", "functions", "tool_choice", "logit_bias", "echo", "suffix", "best_of")


@dataclasses.dataclass
class BatchItem:
    lineno: int
    custom_id: str
    key: str
    body: dict[str, Any] | None  # the job body to publish; None when ``error``
    endpoint: str | None  # "completions" | "chat" for OpenAI lines, None for jaxserve lines
    error: tuple[str, str] | None = None  # (code, message)
    #: the line names its request (a custom_id or id): an error gets an
    #: output line; a line that could not even be read is only reported
    named: bool = True


@dataclasses.dataclass
class InputOptions:
    template: str | None = None
    chat: bool = False  # the rendered template is one user message
    id_column: str | None = None
    batch_id: str | None = None
    labels: list[str] | None = None
    served_model_name: str | None = None
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # body fields a line does not set
    #: body fields a line does not set, for label-scoring lines only (label_prompt, calibrate, few_shot ...)
    label_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)


class InputError(ValueError):
    """The file as a whole cannot be read (unknown format, missing library)."""


def file_identity(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None, bytes]]:
    """(line or row number, record or None, parse error or None, raw bytes)."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            for i, row in enumerate(reader, 2):  # line 1 is the header
                if None in row:
                    yield (
                        i,
                        None,
                        f"row has {len(row) - 1 + len(row[None])} fields, the header {len(reader.fieldnames or [])}",
                        b"",
                    )
                    continue
                yield i, dict(row), None, orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
        return
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError("reading Parquet needs pyarrow: pip install 'jaxserve[parquet]'") from None
        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist(), 1):
            yield i, row, None, orjson.dumps(row, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)
        return
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                yield i, None, f"not valid JSON: {exc}", line
                continue
            if not isinstance(rec, dict):
                yield i, None, f"not a JSON object but {type(rec).__name__}", line
                continue
            yield i, rec, None, line


def _is_openai(rec: dict[str, Any]) -> bool:
    return "custom_id" in rec and ("body" in rec or "url" in rec or "method" in rec)


def read_items(path: str | Path, opts: InputOptions) -> tuple[str, list[BatchItem]]:
    """The batch id and every item of the file, errors included."""
    path = Path(path)
    batch_id = opts.batch_id or file_identity(path)
    template = _template(opts.template) if opts.template else None
    items: list[BatchItem] = []
    seen: dict[str, int] = {}
    for lineno, rec, err, raw in _rows(path):
        if err is not None:
            items.append(
                BatchItem(
                    lineno,
                    f"line-{lineno}",
                    job_key(batch_id, f"line-{lineno}", None),
                    None,
                    None,
                    ("invalid_request", f"line {lineno}: {err}"),
                    named=False,
                )
            )
            continue
        assert rec is not None
        if (
            template is None
            and path.suffix.lower() in (".csv", ".parquet")
            and not ({"prompt", "messages"} & rec.keys())
        ):
            # every row would fail the same way: say so once, with the fix
            example = next((k for k in ("text", "document", "content", "body") if k in rec), next(iter(rec), "text"))
            raise InputError(
                f"{path.name} has the columns {sorted(rec)} but no 'prompt' or 'messages' column: pass --template "
                f"to build each prompt from a row's fields, e.g. --template 'Topic of: {{{{ {example} }}}}'"
            )
        try:
            custom_id, body, endpoint = _interpret(rec, raw, opts, template)
        except _LineError as exc:
            given = rec.get("custom_id") or rec.get("id") or (rec.get(opts.id_column) if opts.id_column else None)
            cid = str(given or f"line-{lineno}")
            error = (exc.code, f"line {lineno}: {exc}")
            items.append(
                BatchItem(lineno, cid, job_key(batch_id, cid, None), None, _endpoint_of(rec), error, named=bool(given))
            )
            continue
        if custom_id in seen:
            msg = f"line {lineno}: custom_id {custom_id!r} was already used on line {seen[custom_id]} (it must be unique in a file)"
            items.append(
                BatchItem(
                    lineno,
                    custom_id,
                    job_key(batch_id, f"{custom_id}#dup{lineno}", None),
                    None,
                    endpoint,
                    ("invalid_request", msg),
                )
            )
            continue
        seen[custom_id] = lineno
        items.append(BatchItem(lineno, custom_id, job_key(batch_id, custom_id, body), body, endpoint))
    return batch_id, items


def _endpoint_of(rec: dict[str, Any]) -> str | None:
    """An OpenAI line's endpoint (its error line is an OpenAI line too, even
    for a url that is not served); None for a jaxserve line."""
    return ENDPOINTS.get(rec.get("url"), "completions") if _is_openai(rec) else None


class _LineError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _template(text: str) -> Any:
    import jinja2

    if text.startswith("@"):
        text = Path(text[1:]).read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
    return env.from_string(text)


def _interpret(
    rec: dict[str, Any], raw: bytes, opts: InputOptions, template: Any
) -> tuple[str, dict[str, Any], str | None]:
    if _is_openai(rec):
        return _openai_line(rec, opts)
    if template is not None:
        try:
            text = template.render(**rec)
        except Exception as exc:  # noqa: BLE001 - jinja2's errors name the missing field
            raise _LineError("invalid_request", f"the template cannot be filled from this row: {exc}") from None
        body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if opts.chat else {"prompt": text}
        cid = rec.get(opts.id_column) if opts.id_column else None
        if opts.id_column and (cid is None or cid == ""):
            raise _LineError("invalid_request", f"the row has no value in the id column {opts.id_column!r}")
    else:
        body = {k: v for k, v in rec.items() if k not in ("id", "message_id", "custom_id")}
        cid = (
            rec.get(opts.id_column)
            if opts.id_column
            else (rec.get("id") or rec.get("message_id") or rec.get("custom_id"))
        )
        body.pop("stream", None)
        if opts.id_column:
            body.pop(opts.id_column, None)
    if cid is None or cid == "":
        cid = "row-" + hashlib.sha256(raw).hexdigest()[:16]
    return str(cid), _with_defaults(body, opts), None


def _openai_line(rec: dict[str, Any], opts: InputOptions) -> tuple[str, dict[str, Any], str]:
    cid = rec.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _LineError("invalid_request", f"custom_id must be a non-empty string, got {cid!r}")
    if rec.get("method", "POST") != "POST":
        raise _LineError("invalid_request", f"method must be POST, got {rec.get('method')!r}")
    url = rec.get("url")
    endpoint = ENDPOINTS.get(url)
    if endpoint is None:
        raise _LineError("invalid_request", f"url {url!r} is not served: use one of {', '.join(ENDPOINTS)}")
    body = rec.get("body")
    if not isinstance(body, dict):
        raise _LineError("invalid_request", f"body must be an object, got {type(body).__name__}")
    body = dict(body)
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise _LineError("invalid_request", f"body.{name} is not supported by jaxserve (got {body[name]!r})")
    if body.get("response_format") in (None, {"type": "text"}):
        body.pop("response_format", None)  # free text: a default (--json-schema) may apply
    if endpoint == "chat" and "messages" not in body:
        raise _LineError("invalid_request", "a /v1/chat/completions body needs messages")
    if endpoint == "completions":
        if "prompt" not in body or "messages" in body:
            raise _LineError("invalid_request", "a /v1/completions body needs a prompt (and no messages)")
        if not isinstance(body["prompt"], str):
            raise _LineError("invalid_request", f"body.prompt must be one string, got {type(body['prompt']).__name__}")
    model = body.pop("model", None)
    if opts.served_model_name is not None and model is not None and model != opts.served_model_name:
        raise _LineError("unknown_model", f"model {model!r} is not served here; use {opts.served_model_name!r}")
    if opts.served_model_name is None and model is not None:
        body["model"] = model  # the worker checks it against the model it serves
    body.pop("stream", None)
    body.pop("stream_options", None)
    body.pop("user", None)
    body.pop("metadata", None)
    return cid, _with_defaults(body, opts), endpoint


def _with_defaults(body: dict[str, Any], opts: InputOptions) -> dict[str, Any]:
    out = {**{k: v for k, v in opts.defaults.items() if v is not None}, **body}
    if opts.labels is not None and "labels" not in out:
        out["labels"] = list(opts.labels)
    if out.get("labels"):
        for k, v in opts.label_defaults.items():
            if v is not None and k not in out:
                # a chat request can only be scored in the chat form
                out[k] = "chat" if (k, v) == ("label_prompt", "plain") and "messages" in out else v
    return out


def content_free(template_text: str) -> str:
    """The template filled with ``"N/A"`` in every field: the content-free
    input a calibrated job is scored against (the instruction kept, the
    document gone). ``@FILE`` reads the template from FILE."""
    import jinja2
    import jinja2.meta

    if template_text.startswith("@"):
        template_text = Path(template_text[1:]).read_text(encoding="utf-8")
    env = jinja2.Environment(autoescape=False, keep_trailing_newline=True)
    names = jinja2.meta.find_undeclared_variables(env.parse(template_text))
    return env.from_string(template_text).render(**dict.fromkeys(names, "N/A"))


def read_few_shot(path: str | Path, template: str | None, labels: list[str] | None) -> list[dict[str, str]]:
    """Worked examples for label scoring from a JSONL file: each line's
    ``label``, and its text: the line filled into ``template`` when one is
    given (as the documents are), else its ``text`` field."""
    tmpl = _template(template) if template else None
    out: list[dict[str, str]] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise InputError(f"{path} line {lineno}: not valid JSON: {exc}") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("label"), str):
                raise InputError(f"{path} line {lineno}: a few-shot example needs a string 'label' field")
            if labels is not None and rec["label"] not in labels:
                raise InputError(
                    f"{path} line {lineno}: label {rec['label']!r} is not one of --labels {','.join(labels)}"
                )
            if tmpl is not None:
                try:
                    text = tmpl.render(**rec)
                except Exception as exc:  # noqa: BLE001 - jinja2's errors name the missing field
                    raise InputError(
                        f"{path} line {lineno}: the template cannot be filled from this example: {exc}"
                    ) from None
            elif isinstance(rec.get("text"), str):
                text = rec["text"]
            else:
                raise InputError(
                    f"{path} line {lineno}: a few-shot example needs a string 'text' field (or give --template)"
                )
            out.append({"text": text, "label": rec["label"]})
    if not out:
        raise InputError(f"{path}: no few-shot examples")
    return out


def canonical(body: dict[str, Any]) -> bytes:
    """A body's identity for deduplication (key order does not matter)."""
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def is_deterministic(body: dict[str, Any]) -> bool:
    """Mirrors ``jaxserve.wire.Job.deterministic`` on an unvalidated body."""
    return bool(body.get("labels")) or body.get("temperature") == 0 or body.get("seed") is not None


__all__ = [
    "BatchItem",
    "InputError",
    "InputOptions",
    "canonical",
    "content_free",
    "file_identity",
    "is_deterministic",
    "read_few_shot",
    "read_items",
]
