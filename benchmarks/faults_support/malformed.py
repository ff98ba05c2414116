"""Seeded generator of malformed jobs (same seed, same jobs, byte for byte).

Each job is ``{"tag", "category", "rk", "body": bytes, "props": {...}}`` as
:mod:`rawamqp` publishes it. The tag (``mal-NNNNN``) rides in ``message_id``
and ``correlation_id``; where one of them is itself the malformed part
(missing, or not UTF-8), the other carries it, so every reply and every dead
letter can be traced back to its job.

Categories (``poison`` ones are the AMQP-level faults: property bytes that
are not UTF-8, timestamps and header values a client library cannot
decode; they are kept to a fixed count because each one can cost the
worker a reconnect per delivery today):

body: random bytes, JSON that is not an object, invalid JSON text, wrong
types in every field, out-of-range values, structural errors (both or
neither of prompt/messages, bad message items), deep nesting, huge strings;
properties: content types, empty/long/missing message ids, no reply_to
(the answer goes to ``<prefix>.results``), expiration 0, odd priorities,
odd headers (valid encodings of unexpected values).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from faults_support.rawamqp import encode_table

WRONG_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    1.5,
    -1.5,
    "",
    "x",
    "NaN",
    "Infinity",
    "-Infinity",
    "1e308",
    [],
    {},
    [1, 2],
    {"a": 1},
    [None],
    10**30,
    -(2**63),
    2**64,
    1e308,
    -1e308,
    "\u0000",
    ["x"],
    {"text": "x"},
]
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "n",
    "priority",
    "deadline",
    "model",
    "tenant",
    "frequency_penalty",
    "presence_penalty",
]
OUT_OF_RANGE: dict[str, list[Any]] = {
    "seed": [-1, 2**32, 2**32 - 1, 2**63, 2**64 - 1, 2**64, 2**100, -(2**63) - 1, 1.5],
    "temperature": [-1, -0.0001, 1e308, 1e-320, 2**64, -1e308, "NaN"],
    "top_p": [-0.5, 0, 0.0, 1.5, 1e308, -1e308, 2],
    "top_k": [-1, -(2**40), 2**40, 2**63, 2**64, 1.5],
    "max_tokens": [0, -1, -(2**63), 10**9, 2**31, 2**63 - 1, 2**64, 1e308, 0.5],
    "max_completion_tokens": [0, -5, 10**12, 2**64],
    "n": [0, 2, -1, 2**64, 1.0000001],
    "deadline": [-1, 0, 1e308, -1e308, 2**64, 1.0],
    "frequency_penalty": [1e308, -1e308, -3, 3, 2**64],
    "presence_penalty": [1e308, -1e308, -3, 3],
    "priority": [2**64, -(2**63), 1e308, "high"],
    "stop": [[""], ["a"] * 17, ["x" * 100_000], [1], [["nested"]], "", [None]],
}


def _valid_body(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        return {"prompt": f"malformed probe {rng.randrange(10**6)} alpha beta", "max_tokens": 4}
    return {"messages": [{"role": "user", "content": f"hello {rng.randrange(1000)}"}], "max_tokens": 4}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def _nested(depth: int, open_: str, close: str, inner: str = "1") -> str:
    return open_ * depth + inner + close * depth


class Generator:
    def __init__(self, seed: int, reply_to: str, prefix: str, now_ms: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.reply_to = reply_to
        self.prefix = prefix
        self.now_ms = now_ms if now_ms is not None else int(time.time() * 1000)

    def _base(self, tag: str, category: str, body: bytes) -> dict[str, Any]:
        rng = self.rng
        return {
            "tag": tag,
            "category": category,
            "rk": f"{self.prefix}.{'interactive' if rng.random() < 0.3 else 'batch'}",
            "body": body,
            "props": {
                "message_id": tag,
                "correlation_id": tag,
                "reply_to": self.reply_to,
                "content_type": "application/json",
                "delivery_mode": 2,
                "headers": {"x-published-at-ms": self.now_ms},
            },
        }

    # ------------------------------------------------------------- bodies
    def body_case(self, tag: str) -> dict[str, Any]:
        rng = self.rng
        kind = rng.choices(
            ["random_bytes", "not_object", "bad_json", "wrong_type", "out_of_range", "structure", "deep_nesting"],
            weights=[10, 6, 8, 30, 22, 14, 3],
        )[0]
        if kind == "random_bytes":
            n = rng.choice([0, 1, 2, 7, 64, 300, 4096])
            return self._base(tag, kind, rng.randbytes(n))
        if kind == "not_object":
            val = rng.choice([0, -1, 1.5, "prompt", [], [1, 2], None, True, False, [{"prompt": "x"}], "{}"])
            return self._base(tag, kind, _dumps(val))
        if kind == "bad_json":
            good = _dumps(_valid_body(rng))
            variants = [
                good[:-1],
                good + b" trailing",
                good + b"}",
                b"\xef\xbb\xbf" + good,
                good.replace(b'"', b"'"),
                b'{"prompt": NaN}',
                b'{"prompt": "x", "max_tokens": Infinity}',
                b'{"prompt": "\xff\xfe bad utf8"}',
                b'{"prompt": "\xc0\xaf overlong"}',
                b'{"prompt": "\\ud800 lone surrogate"}',
                good.decode().encode("utf-16"),
                b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}",
                b'{"prompt": "x", "temperature": 1e999}',
                b'{"prompt": "x", "prompt": 5}',
                b"{" + b" " * 10000,
                b'{"prompt": "x"}\x00',
                b"\x00" * 16,
            ]
            return self._base(tag, kind, rng.choice(variants))
        if kind == "wrong_type":
            body = _valid_body(rng)
            field = rng.choice(FIELDS + ["messages_item", "role", "content", "stop_item"])
            val = rng.choice(WRONG_VALUES)
            if field == "messages_item":
                body.pop("prompt", None)
                body["messages"] = [val]
            elif field in ("role", "content"):
                body.pop("prompt", None)
                body["messages"] = [{"role": "user", "content": "hi", field: val}]
            elif field == "stop_item":
                body["stop"] = ["ok", val]
            elif field == "prompt":
                body.pop("messages", None)
                body["prompt"] = val
            elif field == "messages":
                body.pop("prompt", None)
                body["messages"] = val
            else:
                body[field] = val
            return self._base(tag, f"{kind}:{field}", _dumps(body))
        if kind == "out_of_range":
            body = _valid_body(rng)
            field = rng.choice(sorted(OUT_OF_RANGE))
            body[field] = rng.choice(OUT_OF_RANGE[field])
            return self._base(tag, f"{kind}:{field}", _dumps(body))
        if kind == "structure":
            variants: list[Any] = [
                {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
                {"max_tokens": 4},
                {},
                {"messages": []},
                {"messages": [{"content": "no role"}]},
                {"messages": [{"role": "user"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
                {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                {"messages": [{"role": "nobody", "content": "unknown role"}]},
                {"messages": [{"role": "user", "content": "m"}] * 2000, "max_tokens": 1},
                {"prompt": ""},
                {"prompt": "   \n\t "},
                {"prompt": "\u0000\u0001\u0002 control"},
                {"prompt": "x", "stream": "yes"},
                {"prompt": "x", "model": "some-other-model"},
                {"prompt": "x", "max_tokens": 100_000},
                {"prompt": "x" * 600, "max_tokens": 16},
                {"prompt": "x", "n": 3},
                {"prompt": "x", "unknown_field": {"deep": [1, 2, 3]}},
                {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}},
            ]
            return self._base(tag, kind, _dumps(rng.choice(variants)))
        # deep nesting
        depth = rng.choice([100, 1000, 5000])
        variants_b = [
            _nested(depth, "[", "]").encode(),
            _nested(depth, '{"a":', "}").encode(),
            ('{"prompt": ' + _nested(depth, "[", "]") + "}").encode(),
            ('{"messages": [{"role": "user", "content": ' + _nested(depth, "[", "]", '"x"') + "}]}").encode(),
            ('{"prompt": "x", "stop": ' + _nested(depth, "[", "]", '"s"') + "}").encode(),
        ]
        return self._base(tag, f"deep_nesting:{depth}", rng.choice(variants_b))

    def huge_case(self, tag: str, over_limit: bool) -> dict[str, Any]:
        size = (1 << 20) + 4096 if over_limit else 200_000
        body = _dumps({"prompt": "y" * size, "max_tokens": 4})
        return self._base(tag, "huge_over_1MiB" if over_limit else "huge_under_limit", body)

    # -------------------------------------------------- properties, headers
    def property_case(self, tag: str) -> dict[str, Any]:
        """Odd but decodable AMQP properties and headers."""
        rng = self.rng
        m = self._base(tag, "", _dumps(_valid_body(rng)))
        p = m["props"]
        variants = [
            ("content_type:text/plain", lambda: p.update(content_type="text/plain")),
            ("content_type:charset", lambda: p.update(content_type="application/json; charset=utf-8")),
            ("content_type:empty", lambda: p.update(content_type="")),
            ("content_type:absent", lambda: p.pop("content_type")),
            ("content_encoding:gzip", lambda: p.update(content_encoding="gzip")),
            ("message_id:absent", lambda: p.pop("message_id")),
            ("message_id:empty", lambda: p.update(message_id="")),
            ("message_id:255", lambda: p.update(message_id=(tag + "-" + "k" * 255)[:255])),
            ("message_id:unicode", lambda: p.update(message_id=tag + "-ключ-🔑")),
            ("reply_to:absent", lambda: p.pop("reply_to")),
            ("reply_to:empty", lambda: p.update(reply_to="")),
            ("correlation_id:absent", lambda: p.pop("correlation_id")),
            ("expiration:0", lambda: p.update(expiration="0")),
            ("expiration:1", lambda: p.update(expiration="1")),
            ("expiration:huge", lambda: p.update(expiration="4294967295")),
            ("priority:255", lambda: p.update(priority=255)),
            ("delivery_mode:1", lambda: p.update(delivery_mode=1)),
            ("timestamp:0", lambda: p.update(timestamp=0)),
            ("timestamp:2**32", lambda: p.update(timestamp=2**32)),
            ("type_app_id", lambda: p.update(message_type="x" * 255, app_id="a" * 255)),
            ("headers:published_str", lambda: p.update(headers={"x-published-at-ms": "abc"})),
            ("headers:published_neg", lambda: p.update(headers={"x-published-at-ms": -1})),
            ("headers:published_max", lambda: p.update(headers={"x-published-at-ms": 2**63 - 1})),
            ("headers:published_future", lambda: p.update(headers={"x-published-at-ms": self.now_ms + 10**9})),
            ("headers:published_bool", lambda: p.update(headers={"x-published-at-ms": True})),
            ("headers:published_table", lambda: p.update(headers={"x-published-at-ms": {"a": 1}})),
            ("headers:published_list", lambda: p.update(headers={"x-published-at-ms": [1, 2]})),
            ("headers:published_void", lambda: p.update(headers={"x-published-at-ms": None})),
            ("headers:published_bytes", lambda: p.update(headers={"x-published-at-ms": bytearray(b"\x00\xff")})),
            (
                "headers:published_double_huge",
                lambda: p.update(headers=encode_table([(b"x-published-at-ms", "d", 1.5e308)])),
            ),
            (
                "headers:published_double_nan",
                lambda: p.update(headers=encode_table([(b"x-published-at-ms", "d", float("nan"))])),
            ),
            (
                "headers:published_double_inf",
                lambda: p.update(headers=encode_table([(b"x-published-at-ms", "d", float("inf"))])),
            ),
            ("headers:many", lambda: p.update(headers={f"h{i}": i for i in range(300)})),
            ("headers:big_value", lambda: p.update(headers={"x-big": "v" * 100_000})),
            (
                "headers:forged_x_death",
                lambda: p.update(headers={"x-death": [{"count": "many", "reason": 5}], "x-delivery-count": "abc"}),
            ),
            ("headers:unicode_key", lambda: p.update(headers={"ключ-🔑": "значение"})),
        ]
        name, apply = rng.choice(variants)
        apply()
        if "message_id" not in p or p.get("message_id") == "":
            p["correlation_id"] = tag
        m["category"] = f"props:{name}"
        return m

    def poison_case(self, tag: str, i: int) -> dict[str, Any]:
        """AMQP properties that a strict client cannot decode (variant ``i``
        modulo the number of variants, so every variant is covered)."""
        rng = self.rng
        m = self._base(tag, "", _dumps(_valid_body(rng)))
        p = m["props"]
        bad = b"\xff\xfe\xc3\x28"
        variants = [
            ("content_type", lambda: p.update(content_type=b"application/json" + bad)),
            ("message_id", lambda: p.update(message_id=tag.encode() + bad)),
            ("correlation_id", lambda: p.update(correlation_id=tag.encode() + bad)),
            ("reply_to", lambda: p.update(reply_to=self.reply_to.encode() + bad)),
            ("message_type", lambda: p.update(message_type=bad)),
            ("timestamp_2**64-1", lambda: p.update(timestamp=2**64 - 1)),
            ("header_key", lambda: p.update(headers=encode_table([(b"x-key" + bad, "S", b"v")]))),
            ("header_value_str", lambda: p.update(headers=encode_table([(b"x-published-at-ms", "S", bad)]))),
            ("header_timestamp", lambda: p.update(headers=encode_table([(b"x-when", "T", 2**64 - 1)]))),
        ]
        name, apply = variants[i % len(variants)]
        apply()
        m["category"] = f"poison:{name}"
        return m

    def generate(self, n: int, *, poison: int, huge: int) -> list[dict[str, Any]]:
        """``n`` malformed jobs: ``poison`` of them AMQP-undecodable, ``huge``
        with bodies of 200 KB / over 1 MiB, about 15% odd properties, the
        rest malformed bodies. Deterministic for a given seed."""
        out: list[dict[str, Any]] = []
        specials = ["poison"] * poison + ["huge_over"] * (huge - huge // 2) + ["huge_under"] * (huge // 2)
        kinds = specials + ["props" if self.rng.random() < 0.15 else "body" for _ in range(n - len(specials))]
        self.rng.shuffle(kinds)
        n_poison = 0
        for i, kind in enumerate(kinds):
            tag = f"mal-{i:05d}"
            if kind == "poison":
                out.append(self.poison_case(tag, n_poison))
                n_poison += 1
            elif kind == "huge_over":
                out.append(self.huge_case(tag, True))
            elif kind == "huge_under":
                out.append(self.huge_case(tag, False))
            elif kind == "props":
                out.append(self.property_case(tag))
            else:
                out.append(self.body_case(tag))
        return out
