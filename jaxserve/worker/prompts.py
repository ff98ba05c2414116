"""A job's prompt as token ids: the model check, the chat template, label
prompts, the context-length check, and the response-cache key those ids
determine.

Pure functions of the engine's tokenizer and limits; every failure is a
:class:`RequestError` the job is answered with (``tests/test_queue_worker.py``
and ``tests/test_labels.py`` exercise each).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection
from typing import Any

import orjson

from jaxserve.request_error import RequestError
from jaxserve.tokenizer import labels as label_prompts
from jaxserve.worker.engine_host import EngineInfo

NO_LIMIT = 1 << 30  # an engine that states no maximum length


def served_name(configured: str | None, engine: EngineInfo | None) -> str | None:
    """The name jobs write in ``model``: the configured one, else the
    engine's model name without its folder."""
    if configured:
        return configured
    name = None if engine is None else engine.model_name
    return None if name is None else _base(name)


def _base(name: Any) -> str:
    """A model path's name: the folder's, or a ``.gguf`` file's without the
    extension (``SmolLM2-135M-Instruct-Q8_0.gguf`` is served as
    ``SmolLM2-135M-Instruct-Q8_0``, as a folder of that name would be)."""
    base = os.path.basename(str(name).rstrip("/"))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") and len(base) > 5 else base


def prepare_prompt(
    engine: EngineInfo, served: str | None, job: Any, aliases: Collection[str] = (), model: str | None = None
) -> list[int]:
    """The job's prompt (or chat messages through the template) as token ids.

    The job's model (``model``, when given, instead of the job's own: the
    fallback a re-routed copy is to be served as) must be the served name or
    one of ``aliases``; the engine's model name (with or without its folder)
    only when the served name is that name. A worker serving the ``tiny``
    preset as ``smol`` is not ``tiny``: another worker may serve that name,
    and a job naming it that strays here is refused, never answered by the
    wrong model (``tests/test_queue_models.py``)."""
    name = engine.model_name
    requested = job.model if model is None else model
    own = {served, *aliases}
    if name is not None:
        base = _base(name)
        if served is None or served in (name, base):
            own |= {name, base, os.path.basename(str(name).rstrip("/"))}
    if requested is not None and name is not None and requested not in own:
        raise RequestError("unknown_model", f"model {requested!r} is not served here; this worker serves {served!r}")
    max_len = engine.max_model_len or NO_LIMIT
    tok = engine.tokenizer
    if job.messages is not None:
        _need_chat_template(engine, served, "messages")
        try:
            if hasattr(tok, "encode_chat"):
                # the template writes its own BOS: no post-processor specials
                ids = list(tok.encode_chat(job.messages, add_generation_prompt=True))
            else:
                ids = list(tok.encode(tok.apply_chat_template(job.messages, add_generation_prompt=True)))
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise RequestError(
                "invalid_request", f"messages could not be rendered with the chat template: {exc}"
            ) from None
    else:
        ids = list(tok.encode(job.prompt or ""))
    if not ids:
        raise RequestError("invalid_request", "the prompt is empty")
    if len(ids) + job.params.max_tokens > max_len:
        raise RequestError(
            "context_length_exceeded",
            f"this model's maximum context length is {max_len} tokens; the prompt has {len(ids)} tokens "
            f"and max_tokens is {job.params.max_tokens}",
        )
    return ids


def _need_chat_template(engine: EngineInfo, served: str | None, field: str) -> None:
    """A model without a chat template cannot take ``field``: say so, and
    what the job can send instead (the library's own message names its
    derived folder and a Python keyword no job can give)."""
    if getattr(engine.tokenizer, "chat_templates", None) == {}:
        instead = "`prompt` instead of `messages`" if field == "messages" else '`label_prompt: "plain"` with a `prompt`'
        raise RequestError("invalid_request", f"{field}: model {served!r} has no chat template; send {instead}")


def prepare_labels(engine: EngineInfo, job: Any, served: str | None = None) -> tuple[list[int], list[list[int]], Any]:
    """The prompt and each label's tokens in the job's label form, and the
    content-free request to calibrate against when the job asks for one
    (``jaxserve.tokenizer.labels``: labels tokenized with the text they
    follow, the chat form, few-shot turns)."""
    tok = engine.tokenizer
    if job.label_prompt == "chat":
        _need_chat_template(engine, served or served_name(None, engine), "label_prompt")
    request = label_prompts.LabelRequest(
        labels=tuple(job.labels),
        prompt=job.prompt,
        messages=None if job.messages is None else tuple(job.messages),
        form=job.label_prompt,
        few_shot=tuple(label_prompts.FewShot(t, lab) for t, lab in job.few_shot),
        first_token_only=job.label_normalization == "first",
    )
    try:
        tokens = label_prompts.prepare(tok, request)
        calibration = label_prompts.prepare(tok, request.content_free(job.calibration_input)) if job.calibrate else None
    except label_prompts.LabelPromptError as exc:
        raise RequestError("invalid_request", str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
        raise RequestError(
            "invalid_request", f"the labels' prompt could not be rendered ({job.label_prompt}): {exc}"
        ) from None
    prompt_ids, out = tokens.prompt_ids, tokens.label_ids
    max_len = engine.max_model_len or NO_LIMIT
    longest = max(len(ids) for ids in out)
    if len(prompt_ids) + longest > max_len:
        raise RequestError(
            "context_length_exceeded",
            f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt_ids)} tokens "
            f"and the longest label {longest}",
        )
    return prompt_ids, out, calibration


def cache_key(
    served: str | None, job: Any, prompt_ids: list[int], label_ids: list[list[int]] | None, calibration: Any = None
) -> str:
    """What determines a deterministic job's result, hashed: the served
    model, the prompt's token ids and every parameter that shapes the
    output (not the key, the tenant or the priority)."""
    p = job.params
    what = {
        "model": served,
        "prompt": prompt_ids,
        "labels": label_ids,
        "normalization": job.label_normalization if label_ids is not None else None,
        **({"calibration": calibration.identity()} if calibration is not None else {}),
        "params": None
        if label_ids is not None
        else [
            p.max_tokens,
            p.temperature,
            p.top_p,
            p.top_k,
            p.min_p,
            p.seed if job.seed_given else None,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
            list(p.stop),
        ],
    }
    if label_ids is None and (p.structured is not None or p.logprobs):
        # a constraint changes the text, logprobs the result's fields
        s = p.structured
        what["output"] = [None if s is None else [s.kind, s.value], p.logprobs, p.top_logprobs]
    return hashlib.sha256(orjson.dumps(what)).hexdigest()[:40]
