"""The request bodies of `/v1/chat/completions` and `/v1/completions` as JSON Schema.

`openai_protocol.parse_request` checks every body against these (`api_schema.Body`)
before it reads a field, and `/openapi.json` shows them: one declaration of what the
API accepts. Bounds live here and nowhere else; the parser reads defaults from here too.
Fields that would change the output and are not implemented are declared (without
constraints) so that the document says they are refused unless "off".
"""
from __future__ import annotations

from appliance.daemon import structured, tool_calls
from appliance.daemon.api_schema import Body

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20       # OpenAI's chat bound; completions' is 5 there, 20 here
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 16
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPLATE_KWARGS = 32
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Parameters that would change the output and are not implemented: refused, never
# ignored. Each maps to the value that means "off", which is accepted (None: null, or
# empty). `parse_request` refuses them before the schema does, with a clearer message.
UNSUPPORTED_UNLESS = {"suffix": None, "use_beam_search": False, "length_penalty": 1.0,
                      "prompt_logprobs": None, "guided_decoding_backend": None,
                      "truncate_prompt_tokens": None, "bad_words": None,
                      "allowed_token_ids": None, "spaces_between_special_tokens": True}


def _num(lo: float, hi: float, default: float, doc: str, lo_open: bool = False) -> dict:
    bound = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    return {"type": ["number", "null"], **bound, "maximum": hi, "default": default,
            "description": doc}


def _int(lo: int | None, doc: str, hi: int | None = None, default=None) -> dict:
    out: dict = {"type": ["integer", "null"], "description": doc}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    if default is not None:
        out["default"] = default
    return out


def _flag(default: bool, doc: str) -> dict:
    return {"type": ["boolean", "null"], "default": default, "description": doc}


_NONE = [None, "", [], {}, 0, False]
_TOKEN_ID = {"type": "integer", "minimum": 0}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}

# What both endpoints take.
COMMON = {
    "model": {"type": "string", "minLength": 1, "description": "The served model's id "
              "(GET /v1/models); another name is a 404 model_not_found."},
    "stream": _flag(False, "Answer as server-sent events, ending with `data: [DONE]`."),
    "stream_options": {"type": ["object", "null"], "description": "Only with stream=true.",
                       "properties": {"include_usage": {"type": ["boolean", "null"]}}},
    "max_tokens": _int(1, "Tokens to generate at most (default: what the context leaves). "
                          "0 is allowed on completions with echo=true (score the prompt)."),
    "max_completion_tokens": _int(1, "OpenAI's newer name for max_tokens; wins over it."),
    "n": _int(1, "Choices to generate (each from seed + i).", MAX_CHOICES, 1),
    "best_of": _int(1, "Accepted only equal to n."),
    "temperature": _num(0.0, 2.0, 1.0, "0 is greedy."),
    "top_p": _num(0.0, 1.0, 1.0, "Nucleus sampling.", lo_open=True),
    "top_k": _int(-1, "-1 or 0: off; k > 0: sample among the k likeliest tokens."),
    "min_p": _num(0.0, 1.0, 0.0, "Drop tokens below min_p times the likeliest one."),
    "seed": _int(-(1 << 63), "Same seed, same request: same answer.", (1 << 64) - 1),
    "frequency_penalty": _num(-2.0, 2.0, 0.0, "OpenAI's frequency penalty."),
    "presence_penalty": _num(-2.0, 2.0, 0.0, "OpenAI's presence penalty."),
    "repetition_penalty": _num(0.0, 2.0, 1.0, "vLLM's multiplicative penalty; 1 is off.",
                               lo_open=True),
    "logit_bias": {"type": ["object", "null"], "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                   "description": "Token id (as a string) -> a bias added to its logit.",
                   "propertyNames": {"pattern": "^[0-9]+$",
                                     "description": "keys must be token ids"},
                   "additionalProperties": {"type": "number", "minimum": -100,
                                            "maximum": 100}},
    "stop": {"type": ["string", "array", "null"], "maxItems": MAX_STOP_STRINGS,
             "items": {"type": "string"},
             "description": f"Up to {MAX_STOP_STRINGS} strings that end the output "
                            "(not included unless include_stop_str_in_output)."},
    "stop_token_ids": {"type": ["array", "null"], "maxItems": MAX_STOP_TOKEN_IDS,
                       "items": _TOKEN_ID, "description": "Token ids that end the output."},
    "min_tokens": _int(0, "Tokens to generate before a stop may end the output."),
    "ignore_eos": _flag(False, "Generate max_tokens whatever the model says (benchmarks); "
                               "not with a structured output."),
    "skip_special_tokens": _flag(True, "Leave special tokens out of the text."),
    "return_tokens_as_token_ids": _flag(False, "vLLM's: logprobs name each token "
                                               "'token_id:N' rather than by its text (exact "
                                               "where a token is part of a character)."),
    "include_stop_str_in_output": _flag(False, "Keep the stop string that ended the output."),
    "priority": _int(-(1 << 31), "vLLM's scheduling class: lower is served first. It may "
                     "lower a request's standing below its tenant's class, never raise it "
                     "(docs/operations/tenants.md#priorities).", (1 << 31) - 1),
    "user": {"type": ["string", "null"], "description": "Accepted and ignored."},
    **{name: {"enum": [off] if off is not None else _NONE,
              "description": "Not supported: refused unless off "
                             f"({'null, empty' if off is None else repr(off)})."}
       for name, off in UNSUPPORTED_UNLESS.items()},
}

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": list(CHAT_ROLES)},
    "content": {"type": ["string", "array", "null"], "items": _TEXT_PART,
                "description": "Text, or a list of text parts (no images or audio)."},
    "name": {"type": ["string", "null"]},
    **tool_calls.MESSAGE_FIELDS}, "allOf": tool_calls.MESSAGE_RULES}

CHAT = Body({
    "type": "object", "required": ["model", "messages"],
    "properties": {
        **COMMON,
        "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
        "logprobs": _flag(False, "Return each output token's log probability."),
        "top_logprobs": _int(0, "With logprobs: the k likeliest alternatives per token.",
                             MAX_TOP_LOGPROBS),
        "echo": {"type": ["boolean", "null"], "description": "Completions only: refused."},
        "chat_template_kwargs": {
            "type": ["object", "null"], "maxProperties": MAX_TEMPLATE_KWARGS,
            "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
                              "description": "names the template can read"},
            "description": "vLLM's and SGLang's extra variables for the chat template, e.g. "
                           "{\"enable_thinking\": false} for Qwen3; not messages, tools, "
                           "add_generation_prompt, bos_token or eos_token."},
        **structured.REQUEST_FIELDS,
        **tool_calls.REQUEST_FIELDS,
    }}, "An OpenAI chat completion request.")

COMPLETIONS = Body({
    "type": "object", "required": ["model", "prompt"],
    "properties": {
        **COMMON,
        "max_tokens": {**COMMON["max_tokens"], "minimum": 0},
        "prompt": {"anyOf": [{"type": "string"}, _TOKEN_IDS,
                             {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": {"anyOf": [{"type": "string"}, _TOKEN_IDS]}}],
                   "description": "A string, a list of token ids, or a batch of one of "
                                  "those (one prompt per request)."},
        "logprobs": _int(0, "Return each token's log probability and the k likeliest.",
                         MAX_TOP_LOGPROBS),
        "echo": _flag(False, "Return the prompt before the answer."),
        **{name: {"description": "Chat only: refused here."}
           for name in ("tools", "functions", "tool_choice", "chat_template_kwargs")},
        **structured.REQUEST_FIELDS,
    }}, "An OpenAI (legacy) text completion request.")

BODIES = {"chat": CHAT, "completions": COMPLETIONS}


# endpoint -> field -> its declared default (None: none), looked up per field per request
DEFAULTS = {endpoint: {name: prop.get("default") for name, prop in body.schema["properties"].items()}
            for endpoint, body in BODIES.items()}


def default(endpoint: str, name: str):
    return DEFAULTS[endpoint][name]
