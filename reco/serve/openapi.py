"""The service's OpenAPI 3.1 schema (GET /openapi.json), built from the served model's feature store.

It states exactly what reco.serve.request accepts -- id ranges, the context features of this model,
float32-finite dense values, no unknown fields -- so a request valid under the schema gets 200 and an
invalid one a 4xx (tests/test_serve_fuzz.py checks both with Schemathesis).
"""

from __future__ import annotations

from reco.serve.config import ServeConfig
from reco.serve.features import FeatureStore
from reco.serve.request import F32_MAX, MAX_ID

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


def openapi_schema(store: FeatureStore, cfg: ServeConfig, model: str) -> dict:
    """The OpenAPI document of one worker.

    Args:
        store: the feature store (context features, item id range).
        cfg: the serve settings (max_k, max_candidates, max_body_bytes, n_candidates).
        model: the served variant's name.
    Returns:
        The schema as a JSON-able dict.
    """
    an_id = {"type": "integer", "minimum": -MAX_ID, "maximum": MAX_ID}
    ctx_props: dict[str, dict] = {}
    for name, (_, f) in store.ctx_sparse.items():
        ctx_props[name] = {
            "description": f"id in [0, {f.cardinality}); others are the unknown id 0",
            "anyOf": [an_id, {"type": "array", "items": an_id, "minItems": 1, "maxItems": f.max_len}],
        }
    for name in store.ctx_dense:
        ctx_props[name] = {"type": "number", "minimum": -F32_MAX, "maximum": F32_MAX}

    def error(description: str, retry: bool = False) -> dict:
        out: dict = {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
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
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/RecommendRequest"}}
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "Ranked items; Server-Timing header with per-stage times",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/RecommendResponse"}
                                }
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
        "components": {
            "schemas": {
                "RecommendRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["user_id", "k"],
                    "properties": {
                        "user_id": {**an_id, "description": "encoded user id; unknown -> cold start"},
                        "k": {"type": "integer", "minimum": 1, "maximum": cfg.max_k},
                        # null = not given (the server reads a null field as an omitted one)
                        "context": {
                            "type": ["object", "null"],
                            "additionalProperties": False,
                            "properties": ctx_props,
                        },
                        "candidates": {
                            "type": ["array", "null"],
                            "items": {"type": "integer", "minimum": 1, "maximum": store.item_card - 1},
                            "minItems": 1,
                            "maxItems": cfg.max_candidates,
                            "description": f"item ids to rank; omitted -> {cfg.n_candidates} generated",
                        },
                    },
                },
                "RecommendResponse": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["items", "model"],
                    "properties": {
                        "items": {
                            "type": "array",
                            "maxItems": cfg.max_k,
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["item_id", "score"],
                                "properties": {
                                    "item_id": {"type": "integer"},
                                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                                },
                            },
                        },
                        "model": {"type": "string"},
                    },
                },
                "Error": {
                    "type": "object",
                    "required": ["error", "field"],
                    "properties": {"error": {"type": "string"}, "field": {"type": "string"}},
                },
            }
        },
    }
