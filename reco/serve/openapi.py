"""The service's OpenAPI 3.1 schema (GET /openapi.json), built from the served model's feature store.

Its component schemas are generated from typed models: RecommendRequest is the very model that
reco.serve.request validates requests with (id ranges, the context features of this model,
float32-finite dense values, no unknown fields), so a request valid under the schema gets 200 and an
invalid one a 4xx (tests/test_serve_fuzz.py checks both with Schemathesis); the answers' shapes are the
Structs below. Paths and status codes are declared here.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from reco.serve.config import ServeConfig
from reco.serve.features import FeatureStore
from reco.serve.request import request_schema

REF = "#/components/schemas/{name}"

DESCRIPTION = """\
POST /recommend: features -> candidates -> rank -> top-k for one user.

Server-Timing header (ms) per stage: parse (body read, JSON decode, validation), retrieval (user lookup,
candidate generation), features (the padded model input), queue (waiting for the model), rank (the model
call, the whole coalesced call under dynamic batching, + top-k), serialize, total.

Errors, each with a JSON body {"error": message, "field": name}: 400 invalid JSON or Content-Length;
408 body not received within body_timeout_s; 413 body over max_body_bytes; 415 Content-Type not
application/json (a missing Content-Type included); 422 a field missing, of the wrong type or out of
range; 503 overloaded (queue_limit requests admitted, or the request older than max_wait_ms when admitted
or when its model call would start) or the batcher failed, with Retry-After; 504 the model call did not
finish within model_timeout_s; 500 an internal error (generic message, logged).

Optional request header X-Request-Start: `t=<time the request entered the system>`, since the epoch in
s, ms, us or ns (New Relic's convention); a request's age for max_wait_ms counts from it (else from
when the server started handling it). A malformed header is ignored; a future one means age 0.
Candidate ids outside [1, item cardinality) are a 422; ids inside it but unseen in training are scored
cold-start. Context ids outside their table are the unknown id 0, as in training. An unknown user is
served cold-start.
"""


class RecommendedItem(msgspec.Struct, forbid_unknown_fields=True):
    """One ranked item and its score (the model's probability)."""

    item_id: int
    score: Annotated[float, Meta(ge=0, le=1)]


class Error(msgspec.Struct):
    """A refused request: the message starts with the field at fault, named in `field` ("" if none)."""

    error: str
    field: str


def response_model(max_k: int) -> Any:
    """The 200 answer of POST /recommend (reco.serve.recommend.response_body writes it)."""
    return msgspec.defstruct(
        "RecommendResponse",
        [("items", Annotated[list[RecommendedItem], Meta(max_length=max_k)]), ("model", str)],
        forbid_unknown_fields=True,
        namespace={"__doc__": "The top k items, best first, and the model that ranked them."},
    )


def openapi_schema(store: FeatureStore, cfg: ServeConfig, model: str) -> dict:
    """The OpenAPI document of one worker.

    Args:
        store: the feature store (context features, item id range).
        cfg: the serve settings (max_k, max_candidates, max_body_bytes, n_candidates).
        model: the served variant's name.
    Returns:
        The schema as a JSON-able dict.
    """
    models = [request_schema(store, cfg.max_k, cfg.max_candidates).model, response_model(cfg.max_k), Error]
    _, components = msgspec.json.schema_components(models, ref_template=REF)

    def error(description: str, retry: bool = False) -> dict:
        out: dict = {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": REF.format(name="Error")}}},
        }
        if retry:
            out["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
        return out

    return {
        "openapi": "3.1.0",
        "info": {"title": "reco recommendation service", "version": "1", "description": DESCRIPTION},
        "paths": {
            "/recommend": {
                "post": {
                    "summary": f"Top-k items for a user, ranked by {model}",
                    "requestBody": {
                        "required": True,
                        "description": f"candidates omitted or null: {cfg.n_candidates} generated for the user",
                        "content": {
                            "application/json": {"schema": {"$ref": REF.format(name="RecommendRequest")}}
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "Ranked items; Server-Timing header with per-stage times",
                            "content": {
                                "application/json": {"schema": {"$ref": REF.format(name="RecommendResponse")}}
                            },
                        },
                        "400": error("Invalid JSON or Content-Length"),
                        "408": error(f"Body not received within {cfg.body_timeout_s:g} s"),
                        "413": error(f"Body over {cfg.max_body_bytes} bytes"),
                        "415": error("Content-Type is not application/json"),
                        "422": error("Invalid field (named in `field`)"),
                        "500": error("Internal error (generic message; the server logs one line)"),
                        "503": error(
                            "Overloaded (shed), or the batcher failed; retry after Retry-After s", True
                        ),
                        "504": error(f"Model call not finished within {cfg.model_timeout_s:g} s"),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Liveness and model info",
                    "responses": {
                        "200": {
                            "description": "ok",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "text",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {"schemas": components},
    }
