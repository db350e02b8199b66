"""A /recommend request: reading the body, checking its media type, decoding and validating it.

The body's shape is one typed model (RequestSchema.model, a msgspec Struct built per served model: its
context features, item id range and limits): it validates every request and is the request schema that
GET /openapi.json serves (reco.serve.openapi), so the two cannot disagree. Each field's description in
it is also the "expected ..." of that field's error message.

Integers are what JSON Schema calls integers: any number without a fractional part (66 or 66.0), so a
request valid under the OpenAPI schema is accepted. Every rejection is a RequestError carrying the HTTP
status and the field it names. Error messages describe the offending value with `describe`, which never
recurses: a body nested a thousand levels deep (orjson accepts up to 1024) must cost a 4xx, not a
RecursionError in repr.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np
import orjson
from msgspec import UNSET, Meta, UnsetType
from starlette.requests import Request as HttpRequest

if TYPE_CHECKING:
    from reco.serve.features import FeatureStore

# Ids are JSON "safe integers" (|id| <= 2^53 - 1, as JavaScript's Number.MAX_SAFE_INTEGER): exact as
# doubles too, so 66.0 and 66 agree, and no float near a bound can stand for an integer beyond it
# (orjson reads integer literals beyond 64 bits as rounded floats).
MAX_ID = 2**53 - 1
F32_MAX = float(np.finfo(np.float32).max)  # a dense value beyond it would become inf in the model input


class RequestError(Exception):
    """A request the service refuses: HTTP `status`, the `field` at fault and a message naming it."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


@dataclass
class Request:
    """A validated /recommend request."""

    user_id: int
    k: int
    context_ids: np.ndarray  # [Fc, L] int64
    context_mask: np.ndarray  # [Fc, L] float32
    context_dense: np.ndarray  # [Dc] float32
    candidates: np.ndarray | None  # [M] int64 item ids, or None -> generate


def describe(v: object) -> str:
    """A short description of a decoded JSON value for an error message (bounded, never recursive).

    Args:
        v: any value orjson can produce.
    Returns:
        e.g. "7", "1.5", "string 'noon'", "an array of 3 items", "an object with 2 keys".
    """
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v) if abs(v) < 10**20 else f"an integer of {v.bit_length()} bits"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return f"string {v[:30]!r}{'...' if len(v) > 30 else ''}"
    if isinstance(v, list):
        return f"an array of {len(v)} items"
    if isinstance(v, dict):
        return f"an object with {len(v)} keys"
    return type(v).__name__


def check_content_type(header: str | None) -> None:
    """Accept `application/json` with an optional `charset=utf-8` (JSON is UTF-8, RFC 8259).

    A missing Content-Type is refused too: the body would be guessed at, and every client the project
    ships (Locust, wrk, the tests) sends the header.

    Args:
        header: the request's Content-Type, or None.
    Raises:
        RequestError 415 naming Content-Type.
    """
    media, _, params = (header or "").partition(";")
    charset = "utf-8"
    for p in params.split(";"):
        name, _, value = p.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        got = describe(header[:60]) if header is not None else "none"
        raise RequestError(
            415, "Content-Type", f"Content-Type: expected application/json (charset utf-8), got {got}"
        )


async def read_body(request: HttpRequest, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body, within `timeout_s` of the headers and at most `max_bytes` long.

    Args:
        request: the Starlette request (Content-Length or chunked).
        max_bytes: larger bodies are refused.
        timeout_s: a body still incomplete after this long is refused.
    Returns:
        The body; raises RequestError 400 (bad Content-Length), 408 (too slow) or 413 (too large).
    """
    cl = request.headers.get("content-length")
    if cl is not None:
        if not (cl.isascii() and cl.isdigit()):
            raise RequestError(400, "Content-Length", f"Content-Length: expected an integer, got {cl[:30]!r}")
        if len(cl) > 15 or int(cl) > max_bytes:
            raise RequestError(413, "body", f"body: {cl[:30]} bytes, at most {max_bytes} accepted")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise RequestError(413, "body", f"body: more than {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(
            408, "body", f"body: not received within serve.body_timeout_s={timeout_s:g} s ({size} bytes came)"
        ) from None
    return b"".join(chunks)


def integer(lo: int, hi: int, expected: str | None = None) -> Any:
    """The type of an integer in [lo, hi] as JSON Schema means it (66 or 66.0), described as `expected`.

    A float that must be a multiple of 1: msgspec's int refuses 66.0. Every bound is within +-MAX_ID,
    where doubles hold integers exactly.
    """
    return Annotated[float, Meta(ge=lo, le=hi, multiple_of=1, description=expected)]


TOP = ("user_id", "k", "context", "candidates")
AN_ID = f"|id| <= {MAX_ID}"


class RequestSchema:
    """The /recommend body one served model accepts: the typed model (`model`, a msgspec Struct whose
    context part holds this model's context features) and the decoding of a body through it."""

    def __init__(self, store: FeatureStore, max_k: int, max_candidates: int) -> None:
        """Args:
        store: the feature store (context features, item id range); not referenced afterwards.
        max_k: largest k accepted.
        max_candidates: most candidate ids accepted.
        """
        self.item_card = store.item_card
        self.shape = (len(store.ctx_cols), store.L, len(store.ctx_dense_cols))
        self.sparse = [(name, j, f.cardinality) for name, (j, f) in store.ctx_sparse.items()]
        self.dense = list(store.ctx_dense.items())
        self.context_names = sorted([*store.ctx_sparse, *store.ctx_dense])
        # The "expected ..." of each field's error message is its description in the schema.
        self.expected: dict[str, str] = {
            "user_id": f"an integer in [{-MAX_ID}, {MAX_ID}] (the encoded user id; unknown -> cold start)",
            "k": f"an integer in [1, {max_k}]",
            "context": "an object of this model's context features (null = not given)",
            "candidates": f"a non-empty array of at most {max_candidates} item ids (null = not given)",
            "candidates[]": f"an item id in [1, {store.item_card - 1}]",
        }
        context = self._context_model(store)
        item = integer(1, store.item_card - 1, self.expected["candidates[]"])
        items = Annotated[list[item], Meta(min_length=1, max_length=max_candidates)]
        self.model = msgspec.defstruct(
            "RecommendRequest",
            [
                ("user_id", integer(-MAX_ID, MAX_ID, self.expected["user_id"])),
                ("k", integer(1, max_k, self.expected["k"])),
                ("context", Annotated[context | None, Meta(description=self.expected["context"])], None),
                ("candidates", Annotated[items | None, Meta(description=self.expected["candidates"])], None),
            ],
            forbid_unknown_fields=True,
            namespace={
                "__doc__": "One user's request: rank candidates (given or generated), return the top k."
            },
        )

    def _context_model(self, store: FeatureStore) -> Any:
        """The Struct of this model's context features, each optional (not given: the unknown id 0 / 0.0)."""
        ctx_fields: list[tuple[str, Any, Any]] = []
        for name, (_, f) in store.ctx_sparse.items():
            expected = self.expected[f"context.{name}"] = (
                f"an integer id or a non-empty array of at most {f.max_len} ({AN_ID}); ids outside "
                f"[0, {f.cardinality}) are the unknown id 0"
            )
            ids = Annotated[list[integer(-MAX_ID, MAX_ID)], Meta(min_length=1, max_length=f.max_len)]
            one_or_more = integer(-MAX_ID, MAX_ID) | ids
            ctx_fields.append((name, Annotated[one_or_more, Meta(description=expected)] | UnsetType, UNSET))
        for name in store.ctx_dense:
            expected = self.expected[f"context.{name}"] = f"a number with |x| <= {F32_MAX:.6g} (float32)"
            number = Annotated[float, Meta(ge=-F32_MAX, le=F32_MAX, description=expected)]
            ctx_fields.append((name, number | UnsetType, UNSET))
        return msgspec.defstruct(
            "RecommendContext",
            ctx_fields,
            kw_only=True,
            forbid_unknown_fields=True,
            namespace={"__doc__": "Context features by name; one left out is the unknown id 0 (dense: 0)."},
        )

    def parse(self, body: bytes) -> Request:
        """Decode and validate a /recommend body.

        Args:
            body: the raw JSON body.
        Returns:
            The validated Request; raises RequestError (400 invalid JSON, 422 a bad field) naming the field.
        """
        try:
            # orjson first, then the model: a nesting limit, duplicate keys read as the last one, and
            # invalid JSON anywhere a 400 even after a field the model would refuse.
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise RequestError(400, "body", f"body: invalid JSON ({str(e)[:120]})") from None
        try:
            r = msgspec.convert(obj, self.model)
        except msgspec.ValidationError as e:
            raise self._refusal(str(e), obj) from None
        n_sparse, L, n_dense = self.shape
        ids = np.zeros((n_sparse, L), dtype=np.int64)
        mask = np.zeros((n_sparse, L), dtype=np.float32)
        mask[:, 0] = 1.0  # a feature not given: the unknown id 0, length 1
        dense = np.zeros(n_dense, dtype=np.float32)
        if r.context is not None:
            for name, j, card in self.sparse:
                v = getattr(r.context, name)
                if v is not UNSET:
                    vals = [v] if isinstance(v, float) else v
                    ids[j, : len(vals)] = [int(x) if 0 <= x < card else 0 for x in vals]
                    mask[j] = 0.0
                    mask[j, : len(vals)] = 1.0
            for name, j in self.dense:
                v = getattr(r.context, name)
                if v is not UNSET:
                    dense[j] = v
        cands = r.candidates
        if cands is not None:  # duplicates scored once
            cands = np.array(list(dict.fromkeys(cands)), dtype=np.int64)
        return Request(int(r.user_id), int(r.k), ids, mask, dense, cands)

    def _refusal(self, error: str, obj: object) -> RequestError:
        """The 422 for a body the model refused with `error` (msgspec's message), naming the field and
        describing the value there from `obj` (the decoded body)."""
        if not isinstance(obj, dict):
            return RequestError(422, "body", f"body: expected a JSON object, got {describe(obj)}")
        if error.startswith("Object missing required field"):
            name = next(n for n in TOP if n not in obj)  # only the top level has required fields
            return RequestError(422, name, f"{name}: required field missing (expected {self.expected[name]})")
        if error.startswith("Object contains unknown field"):
            return self._unknown_field(obj)
        at = error.rfind(" - at `$.")  # msgspec's own messages hold no request text besides the path
        path = error[at + len(" - at `$.") : -1] if at >= 0 else ""
        top, _, rest = path.partition(".")
        top, _, index = top.partition("[")
        value = obj.get(top)
        if top == "context" and rest:
            name = re.sub(r"\[\d+\]$", "", rest)  # an element of a multi-valued feature: the feature
            field = f"context.{name}"
            value = value.get(name) if isinstance(value, dict) else value
        elif top == "candidates" and index:
            field, value = f"candidates[{index}", value[int(index.rstrip("]"))]
            if isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer():
                return self._unknown_items(obj["candidates"])  # an integer, but no item's id
            field_expected = self.expected["candidates[]"]
            return RequestError(422, field, f"{field}: expected {field_expected}, got {describe(value)}")
        else:
            field = top if top in self.expected else "body"
        expected = self.expected.get(field, "a valid /recommend body")
        return RequestError(422, field, f"{field}: expected {expected}, got {describe(value)}")

    def _unknown_field(self, obj: dict) -> RequestError:
        """The first field (in body order, as the model reads it) that the model does not know."""
        for key, v in obj.items():
            if key not in TOP:
                return RequestError(422, key[:60], f"{key[:60]}: unknown field (expected {', '.join(TOP)})")
            if key == "context" and isinstance(v, dict):
                for name in v:
                    if name not in self.context_names:
                        field = f"context.{name[:60]}"
                        return RequestError(
                            422,
                            field,
                            f"{field}: not a context feature of this model (expected one of {self.context_names})",
                        )
        return RequestError(422, "body", "body: an unknown field")  # not reached: msgspec found one

    def _unknown_items(self, cands: list) -> RequestError:
        """Every candidate id outside [1, item cardinality), listed at once (ids come in batches)."""
        bad = [
            c
            for c in cands
            if isinstance(c, int | float) and not isinstance(c, bool) and not 1 <= c < self.item_card
        ]
        return RequestError(
            422,
            "candidates",
            f"candidates: {len(bad)} unknown item id(s) [{', '.join(describe(c) for c in bad[:10])}] "
            f"(expected ids in [1, {self.item_card}))",
        )


_SCHEMAS: weakref.WeakKeyDictionary[FeatureStore, dict[tuple[int, int], RequestSchema]] = (
    weakref.WeakKeyDictionary()
)


def request_schema(store: FeatureStore, max_k: int, max_candidates: int) -> RequestSchema:
    """The RequestSchema of `store` with these limits, built once per store (it holds no reference to it)."""
    per_store = _SCHEMAS.setdefault(store, {})
    schema = per_store.get((max_k, max_candidates))
    if schema is None:
        schema = per_store[max_k, max_candidates] = RequestSchema(store, max_k, max_candidates)
    return schema


def parse_request(body: bytes, store: FeatureStore, max_k: int, max_candidates: int) -> Request:
    """Decode and validate a /recommend body against `store`'s request schema (RequestSchema.parse).

    Args:
        body: the raw JSON body.
        store: the feature store (context feature names, item id range).
        max_k: largest k accepted.
        max_candidates: most candidate ids accepted.
    Returns:
        The validated Request; raises RequestError (400 invalid JSON, 422 a bad field) naming the field.
    """
    return request_schema(store, max_k, max_candidates).parse(body)
