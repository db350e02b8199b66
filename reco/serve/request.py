"""A /recommend request: reading the body, checking its media type, decoding and validating it.

Integers are what JSON Schema calls integers: any number without a fractional part (66 or 66.0), so a
request valid under the OpenAPI schema is accepted. Every rejection is a RequestError carrying the HTTP
status and the field it names. Error messages
describe the offending value with `describe`, which never recurses: a body nested a thousand levels
deep (orjson accepts up to 1024) must cost a 4xx, not a RecursionError in repr.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import orjson
from starlette.requests import Request as HttpRequest

if TYPE_CHECKING:
    from reco.serve.features import FeatureStore

FIELDS = ("user_id", "context", "k", "candidates")
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


def parse_request(body: bytes, store: FeatureStore, max_k: int, max_candidates: int) -> Request:
    """Decode and validate a /recommend body.

    Args:
        body: the raw JSON body.
        store: the feature store (context feature names, item id range).
        max_k: largest k accepted.
        max_candidates: most candidate ids accepted.
    Returns:
        The validated Request; raises RequestError (400 invalid JSON, 422 a bad field) naming the field.
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestError(400, "body", f"body: invalid JSON ({str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise RequestError(422, "body", f"body: expected a JSON object, got {describe(obj)}")
    for name in obj:
        if name not in FIELDS:
            raise RequestError(422, name[:60], f"{name[:60]}: unknown field (expected {', '.join(FIELDS)})")
    user_id = _int_field(obj, "user_id", -MAX_ID, MAX_ID)
    k = _int_field(obj, "k", 1, max_k)
    ctx_ids, ctx_mask, ctx_dense = _parse_context(obj.get("context"), store)
    cands = obj.get("candidates")
    if cands is not None:
        cands = _parse_candidates(cands, store, max_candidates)
    return Request(user_id, k, ctx_ids, ctx_mask, ctx_dense, cands)


def _as_int(v: object, lo: int = -MAX_ID, hi: int = MAX_ID) -> int | None:
    """`v` as an int in [lo, hi] when it is a JSON integer (66 or 66.0), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    if isinstance(v, float):
        if not v.is_integer():  # also NaN and inf
            return None
        v = int(v)
    return v if lo <= v <= hi else None


def _int_field(obj: dict, name: str, lo: int, hi: int) -> int:
    if name not in obj:
        raise RequestError(422, name, f"{name}: required field missing (expected an integer)")
    v = _as_int(obj[name], lo, hi)
    if v is None:
        raise RequestError(
            422, name, f"{name}: expected an integer in [{lo}, {hi}], got {describe(obj[name])}"
        )
    return v


def _parse_context(ctx: object, store: FeatureStore) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Context features by schema name -> ids [Fc, L], mask [Fc, L], dense [Dc]; missing -> unknown / 0."""
    ids = np.zeros((len(store.ctx_cols), store.L), dtype=np.int64)
    mask = np.zeros((len(store.ctx_cols), store.L), dtype=np.float32)
    mask[:, 0] = 1.0  # the unknown id 0, length 1
    dense = np.zeros(len(store.ctx_dense_cols), dtype=np.float32)
    if ctx is None:
        return ids, mask, dense
    if not isinstance(ctx, dict):
        raise RequestError(422, "context", f"context: expected an object, got {describe(ctx)}")
    for name, v in ctx.items():
        field = f"context.{name[:60]}"
        if name in store.ctx_sparse:
            j, f = store.ctx_sparse[name]
            one = _as_int(v)
            vals = [one] if one is not None else v
            if isinstance(vals, list) and 1 <= len(vals) <= f.max_len:
                vals = [_as_int(x) for x in vals]
            if not isinstance(vals, list) or not 1 <= len(vals) <= f.max_len or None in vals:
                raise RequestError(
                    422,
                    field,
                    f"{field}: expected an integer id or a non-empty array of at most {f.max_len} "
                    f"(|id| <= {MAX_ID}), got {describe(v)}",
                )
            ids[j, : len(vals)] = [x if 0 <= x < f.cardinality else 0 for x in vals]
            mask[j] = 0.0
            mask[j, : len(vals)] = 1.0
        elif name in store.ctx_dense:
            # 1e39 is a finite double but inf as float32, and inf in the input is a null score out.
            if not isinstance(v, int | float) or isinstance(v, bool) or not -F32_MAX <= v <= F32_MAX:
                raise RequestError(
                    422,
                    field,
                    f"{field}: expected a number with |x| <= {F32_MAX:.6g} (float32), got {describe(v)}",
                )
            dense[store.ctx_dense[name]] = v
        else:
            known = sorted([*store.ctx_sparse, *store.ctx_dense])
            raise RequestError(
                422, field, f"{field}: not a context feature of this model (expected one of {known})"
            )
    return ids, mask, dense


def _parse_candidates(cands: object, store: FeatureStore, max_candidates: int) -> np.ndarray:
    if not isinstance(cands, list) or not cands:
        raise RequestError(
            422, "candidates", f"candidates: expected a non-empty array of item ids, got {describe(cands)}"
        )
    if len(cands) > max_candidates:
        raise RequestError(
            422, "candidates", f"candidates: at most {max_candidates} item ids, got {len(cands)}"
        )
    ids = [_as_int(c) for c in cands]
    for i, c in enumerate(ids):
        if c is None:
            raise RequestError(
                422, f"candidates[{i}]", f"candidates[{i}]: expected an item id, got {describe(cands[i])}"
            )
    arr = np.array(list(dict.fromkeys(ids)), dtype=np.int64)  # duplicates scored once
    bad = store.check_items(arr)
    if len(bad):
        raise RequestError(
            422,
            "candidates",
            f"candidates: {len(bad)} unknown item id(s) {bad[:10].tolist()} "
            f"(expected ids in [1, {store.item_card}))",
        )
    return arr
