"""API keys: who is calling, and what their requests carry.

A keys file (YAML or JSON) maps each key to a tenant, a default priority
and the models it may use::

    keys:
      sk-team-a-1:
        tenant: team-a        # the job's tenant: the workers' limits, costs and metrics
        priority: 200         # 0-255, higher first; the X-Jaxserve-Priority header overrides it
        models: [tiny, chat]  # absent: every model
      sk-batch-robot:
        tenant: pipelines
        priority: 10

Without a keys file the gateway is open: every request is tenant
``default`` (the gateway logs that at start). With one, a missing or
unknown key is 401 and a model outside the key's list is 404, as OpenAI
answers a model an organisation cannot see. Keys are compared in constant
time (``hmac.compare_digest``) so a timing probe learns nothing.
"""

from __future__ import annotations

import dataclasses
import hmac
from pathlib import Path
from typing import Any

import yaml

from jaxserve.gateway.errors import ApiError, not_found, unauthorized

DEFAULT_TENANT = "default"


@dataclasses.dataclass(frozen=True)
class Principal:
    """The caller of one request."""

    tenant: str
    priority: int | None = None
    models: frozenset[str] | None = None  # None: every model
    key_hint: str = ""  # the key's last four characters, for logs

    def check_model(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise not_found(
                f"The model {model!r} does not exist or you do not have access to it.", "model", "model_not_found"
            )


OPEN = Principal(DEFAULT_TENANT)


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the entry."""


def _principal(key: str, entry: Any) -> Principal:
    where = f"keys[{key[:4]}...]"
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: an entry is a mapping with tenant, priority, models (got {entry!r})")
    tenant = entry.get("tenant")
    if not isinstance(tenant, str) or not tenant or len(tenant) > 256:
        raise KeysFileError(f"{where}.tenant: a string of 1-256 characters is required (got {tenant!r})")
    priority = entry.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
    ):
        raise KeysFileError(f"{where}.priority: an integer 0-255 (got {priority!r})")
    models = entry.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)):
        raise KeysFileError(f"{where}.models: a list of model names (got {models!r})")
    return Principal(tenant, priority, None if models is None else frozenset(models), key[-4:])


@dataclasses.dataclass(frozen=True)
class KeyRing:
    """The keys of a keys file; an empty ring with ``open=True`` lets
    everyone in as tenant ``default``."""

    entries: tuple[tuple[str, Principal], ...] = ()
    open: bool = True

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise KeysFileError(f"{path}: cannot read the keys file ({exc})") from None
        keys = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(keys, dict) or not keys:
            raise KeysFileError(f"{path}: expected a mapping 'keys:' of key -> {{tenant, priority, models}}")
        entries = []
        for key, entry in keys.items():
            if not isinstance(key, str) or len(key) < 8:
                raise KeysFileError(f"{path}: every key is a string of at least 8 characters (got {key!r})")
            entries.append((key, _principal(key, entry)))
        return cls(tuple(entries), open=False)

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller of a request with this ``Authorization`` header."""
        if self.open:
            return OPEN
        if not authorization:
            raise unauthorized(
                "You didn't provide an API key. Send it in the Authorization header as 'Bearer YOUR_KEY'."
            )
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("The Authorization header must be 'Bearer YOUR_KEY'.")
        found: Principal | None = None
        for key, principal in self.entries:  # every entry compared: the time does not tell which matched
            if hmac.compare_digest(key.encode(), token.encode()):
                found = principal
        if found is None:
            raise unauthorized(f"Incorrect API key provided: ...{token[-4:]}.")
        return found


def priority_header(value: str | None, default: int | None) -> int | None:
    """The job priority from ``X-Jaxserve-Priority`` (0-255), else the key's."""
    if value is None or value == "":
        return default
    try:
        priority = int(value)
    except ValueError:
        priority = -1
    if not 0 <= priority <= 255:
        raise ApiError(
            400,
            f"X-Jaxserve-Priority must be an integer 0-255, got {value!r}",
            "invalid_request_error",
            "X-Jaxserve-Priority",
            "invalid_priority",
        )
    return priority


def queue_header(value: str | None) -> str:
    """The queue class from ``X-Jaxserve-Queue``: ``interactive`` (the
    default: admission refuses what cannot start in time) or ``batch`` (a
    synchronous caller that would rather wait behind the batch work than be
    refused: an offline pipeline on the SDK)."""
    if value is None or value == "":
        return "interactive"
    if value not in ("interactive", "batch"):
        raise ApiError(
            400,
            f"X-Jaxserve-Queue must be interactive or batch, got {value!r}",
            "invalid_request_error",
            "X-Jaxserve-Queue",
            "invalid_queue",
        )
    return value
