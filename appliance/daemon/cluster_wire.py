"""What the boxes of a cluster say to each other over HTTP (docs/operations/cluster.md).

A prefill box (the front) sends each decode to a decode box as one `POST
/cluster/v1/decode` whose body is a `DecodeOrder`; the decode box answers with a stream
of JSON lines (``application/x-ndjson``), one event per line:

- ``{"event": "kv_imported", "transport", "nbytes", "seconds"}``: once, as soon as the
  prompt's KV is on the decode box (pulled, or recomputed there): the front may then
  release the prefill worker's blocks;
- ``{"event": "tokens", "tokens": [...], "logprobs": [...] | null, "finish_reason":
  null | "stop" | "length"}``: new tokens; the last one has a finish reason;
- ``{"event": "error", "message", "code"}``: the decode failed; nothing follows.

Plain JSON both ways: a box never unpickles what another sent. The KV handle and the
prefill worker's pool info are `appliance.kv.nixl_transport` records as JSON strings,
which only the decode worker reads."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from appliance.daemon.api_schema import Body
from appliance.engines.messages import GuidedDecoding, SamplingParams

NDJSON = "application/x-ndjson"
DECODE_PATH = "/cluster/v1/decode"
STATUS_PATH = "/cluster/v1/status"

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_PARAMS = {
    "type": "object", "required": ["max_tokens"], "additionalProperties": False,
    "properties": {
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": _NUM, "top_p": _NUM, "seed": {"type": ["integer", "null"]},
        "stop_token_ids": {"type": "array", "items": _INT},
        "ignore_eos": {"type": "boolean"}, "top_k": _INT,
        "frequency_penalty": _NUM, "presence_penalty": _NUM,
        "logit_bias": {"type": "array", "items": {
            "type": "array", "items": _NUM, "minItems": 2, "maxItems": 2}},
        "logprobs": {"type": ["integer", "null"], "minimum": 0},
        "prompt_logprobs": {"type": ["integer", "null"], "minimum": 0},
        "guided": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["kind"], "additionalProperties": False,
            "properties": {"kind": {"type": "string"}, "source": {"type": "string"}}}]},
        "min_tokens": {"type": "integer", "minimum": 0},
        "repetition_penalty": _NUM, "min_p": _NUM,
    }}

DECODE_BODY = Body({
    "type": "object", "additionalProperties": False,
    "required": ["request_id", "tenant", "model", "prompt", "first_token", "params", "kv",
                 "layout"],
    "properties": {
        "request_id": {"type": "string", "minLength": 1, "maxLength": 200},
        "tenant": {"type": "string"},
        "weight": {"type": "number", "exclusiveMinimum": 0},
        "priority": {"type": "integer"},
        "model": {"type": "string"},
        "prompt": {"type": "array", "items": {"type": "integer", "minimum": 0},
                   "minItems": 1},
        "first_token": {"type": "integer", "minimum": 0},
        "params": _PARAMS,
        "layout": {"type": "string", "description": "the prefill worker's KV layout tag"},
        "kv": {"type": "object", "required": ["pool", "handle"], "additionalProperties": False,
               "properties": {
                   "pool": {"type": "string",
                            "description": "the prefill worker's NixlPoolInfo as JSON; "
                                           "'' for a simulated engine"},
                   "handle": {"type": "string",
                              "description": "the request's NixlKvHandle as JSON"}}},
    }}, "One request's decode, its prompt's KV on the calling box (pulled with NIXL READ)")


@dataclass(frozen=True, slots=True)
class DecodeOrder:
    """A decode one box asks another to run (the body of `POST /cluster/v1/decode`)."""

    request_id: str
    tenant: str
    model: str
    prompt: list[int]
    first_token: int
    params: SamplingParams
    layout: str
    kv_pool: str            # NixlPoolInfo JSON ("" : simulated)
    kv_handle: str          # NixlKvHandle JSON
    weight: float = 1.0
    priority: int = 0

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "tenant": self.tenant, "weight": self.weight,
                "priority": self.priority, "model": self.model, "prompt": list(self.prompt),
                "first_token": self.first_token, "params": params_json(self.params),
                "layout": self.layout, "kv": {"pool": self.kv_pool, "handle": self.kv_handle}}


def params_json(p: SamplingParams) -> dict:
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    out["stop_token_ids"] = list(p.stop_token_ids)
    out["logit_bias"] = [[t, b] for t, b in p.logit_bias]
    out["guided"] = (None if p.guided is None
                     else {"kind": p.guided.kind, "source": p.guided.source})
    return out


def parse_decode_order(body) -> DecodeOrder:
    """The order from a request body; the schema's 400 (`ApiError`) if it breaks it."""
    DECODE_BODY.check(body)
    p = dict(body["params"])
    p["stop_token_ids"] = tuple(p.get("stop_token_ids", ()))
    p["logit_bias"] = tuple((int(t), float(b)) for t, b in p.get("logit_bias", ()))
    if p.get("guided") is not None:
        p["guided"] = GuidedDecoding(p["guided"]["kind"], p["guided"].get("source", ""))
    return DecodeOrder(
        request_id=body["request_id"], tenant=body["tenant"], model=body["model"],
        prompt=list(body["prompt"]), first_token=body["first_token"],
        params=SamplingParams(**p), layout=body["layout"], kv_pool=body["kv"]["pool"],
        kv_handle=body["kv"]["handle"], weight=float(body.get("weight", 1.0)),
        priority=int(body.get("priority", 0)))


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries the cluster key (constant-time compare)."""
    import hmac
    if not key or not header:
        return False
    return hmac.compare_digest(header.encode(), f"Bearer {key}".encode())
