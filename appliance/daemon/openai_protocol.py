"""OpenAI request parsing and response shapes. Pure functions: no aiohttp, no workers.

A body is first checked against its JSON Schema (`openai_schema`, which /openapi.json
shows too); the parser then only converts, and applies the rules a schema cannot say.
Every rejection is an `ApiError` carrying the HTTP status and OpenAI's error body
fields, so the HTTP layer turns all of them into the same JSON shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from appliance.daemon.api_error import ApiError, bad  # noqa: F401 (ApiError: re-exported)
from appliance.daemon.openai_schema import BODIES, DEFAULTS, UNSUPPORTED_UNLESS
from appliance.daemon.structured import parse_guided
from appliance.daemon.tool_calls import ToolRequest, message_fields, parse_tools
from appliance.engines.messages import GuidedDecoding, SamplingParams

@dataclass(slots=True)
class GenerationRequest:
    endpoint: str                       # "chat" | "completions"
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str] = field(default_factory=list)
    messages: list[dict] | None = None  # chat
    prompt_text: str | None = None      # completions
    prompt_ids: list[int] | None = None  # completions given token ids
    ignore_eos: bool = False
    top_k: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None         # None: none; k: each token's and the top k
    echo: bool = False                  # completions: the prompt comes back before the answer
    n: int = 1                          # choices
    guided: GuidedDecoding | None = None  # structured output: what the text must match
    min_tokens: int = 0                 # vLLM's sampling extensions
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    tools: ToolRequest | None = None    # chat: the tools offered, and tool_choice
    priority: int | None = None         # vLLM's: lower is served first; None: the tenant's
    chat_template_kwargs: dict | None = None  # chat: extra variables for the template
    thinking: bool = False              # chat: the rendered prompt opened a <think> block
    tokens_as_ids: bool = False         # logprobs name tokens "token_id:N" (vLLM's option)

    def sampling(self, max_tokens: int, stop_token_ids: tuple[int, ...] = (),
                 choice: int = 0) -> SamplingParams:
        """Choice i of n draws from seed + i: different answers, the first one what n = 1
        gives."""
        seed = None if self.seed is None else self.seed + choice
        if seed is not None and seed >= 1 << 64:      # torch takes seeds below 2**64
            seed -= 1 << 64
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=seed,
                              stop_token_ids=tuple(stop_token_ids) + self.stop_token_ids,
                              ignore_eos=self.ignore_eos, top_k=self.top_k,
                              frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty,
                              logit_bias=self.logit_bias, logprobs=self.logprobs,
                              prompt_logprobs=self.logprobs if self.echo else None,
                              guided=self.guided, min_tokens=self.min_tokens,
                              repetition_penalty=self.repetition_penalty, min_p=self.min_p)


def _values(body: dict, endpoint: str) -> dict:
    """Every declared field: the body's, or its declared default when absent or null
    (the schema checked it). One merge per request rather than a look-up per field."""
    return DEFAULTS[endpoint] | {k: v for k, v in body.items() if v is not None}


def _int(value):
    """JSON Schema's integers include 2.0 (as OpenAI's own server takes it): as an int."""
    return None if value is None else int(value)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a JSON string key) to a bias in [-100, 100]. Ids beyond
    the vocabulary are refused by `completion.check_token_ids`, which knows it."""
    bias = body.get("logit_bias")
    return tuple(sorted((int(k), float(v)) for k, v in bias.items())) if bias else ()


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    return tuple(sorted({int(t) for t in ids})) if ids else ()


def _logprobs(body: dict, endpoint: str) -> int | None:
    """Chat: logprobs=true and top_logprobs=k. Completions: logprobs=k."""
    if endpoint == "chat":
        on = body.get("logprobs")
        top = body.get("top_logprobs")
        if top is not None and not on:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return _int(top or 0) if on else None
    return _int(body.get("logprobs"))


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)      # text parts (the schema's)


def _messages(body: dict) -> list[dict]:
    return [{"role": m["role"], "content": _content_text(m.get("content")), **message_fields(m)}
            for m in body["messages"]]


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    prompt = body["prompt"]
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]           # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    return None, [int(t) for t in prompt]


# What the daemon itself passes to a chat template: a request may not replace it.
TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _template_kwargs(body: dict) -> dict | None:
    kwargs = body.get("chat_template_kwargs") or None
    if kwargs is None:
        return None
    for name in TEMPLATE_RESERVED:
        if name in kwargs:
            raise bad(f"'chat_template_kwargs' may not set {name!r} (the request's own "
                      "fields set it)", "chat_template_kwargs")
    return kwargs


def parse_body(raw: bytes, endpoint: str) -> GenerationRequest:
    """A request body as bytes -> the request (or the 400 that says what is wrong)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad(f"malformed JSON body: {exc}", None, "invalid_json") from None
    return parse_request(body, endpoint)


def parse_request(body, endpoint: str) -> GenerationRequest:
    for unsupported, off in UNSUPPORTED_UNLESS.items() if isinstance(body, dict) else ():
        value = body.get(unsupported)
        if value is None or value == off or (off is None and not value):   # [] or "" = none
            continue
        raise bad(f"'{unsupported}' is not supported", unsupported, "unsupported_parameter")
    BODIES[endpoint].check(body)
    values = _values(body, endpoint)
    n = _int(values["n"])
    guided = parse_guided(body)
    if body.get("best_of") not in (None, n):
        raise bad("'best_of' other than n is not supported", "best_of",
                  "unsupported_parameter")
    stream = values["stream"]
    include_usage = False
    if body.get("stream_options") is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with stream=true", "stream_options")
        include_usage = bool(body["stream_options"].get("include_usage"))
    echo = bool(body.get("echo"))
    if echo and endpoint == "chat":
        raise bad("'echo' is not supported", "echo", "unsupported_parameter")
    max_tokens = _int(body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = _int(body.get("max_tokens"))
        if max_tokens == 0 and not echo:      # 0 with echo: score the prompt
            raise bad("'max_tokens' must be at least 1 (0 only with echo=true)", "max_tokens")
    ignore_eos = values["ignore_eos"]
    if ignore_eos and guided is not None:
        raise bad("'ignore_eos' cannot be combined with a structured output: the grammar "
                  "ends the output", "ignore_eos")
    stop = body.get("stop")
    top_k = _int(body.get("top_k")) or 0
    req = GenerationRequest(
        endpoint=endpoint, model=body["model"], stream=stream, include_usage=include_usage,
        max_tokens=max_tokens, temperature=float(values["temperature"]),
        top_p=float(values["top_p"]), seed=_int(body.get("seed")),
        stop=[stop] if isinstance(stop, str) else list(stop or ()), ignore_eos=ignore_eos,
        top_k=max(top_k, 0),     # -1 is vLLM's "off", as 0
        frequency_penalty=float(values["frequency_penalty"]),
        presence_penalty=float(values["presence_penalty"]),
        logit_bias=_logit_bias(body), logprobs=_logprobs(body, endpoint), echo=echo, n=n,
        guided=guided, min_tokens=_int(body.get("min_tokens")) or 0,
        repetition_penalty=float(values["repetition_penalty"]),
        min_p=float(values["min_p"]),
        stop_token_ids=_stop_token_ids(body),
        skip_special_tokens=values["skip_special_tokens"],
        include_stop_str_in_output=values["include_stop_str_in_output"],
        priority=_int(body.get("priority")),
        tokens_as_ids=values["return_tokens_as_token_ids"])
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad(f"'min_tokens' ({req.min_tokens}) must not exceed max_tokens "
                  f"({req.max_tokens})", "min_tokens")
    if endpoint == "chat":
        req.messages = _messages(body)
        req.tools = parse_tools(body)
        req.chat_template_kwargs = _template_kwargs(body)
    else:
        for name in ("tools", "functions", "tool_choice", "chat_template_kwargs"):
            if body.get(name):
                raise bad(f"'{name}' is not supported on completions; use "
                          "/v1/chat/completions", name, "unsupported_parameter")
        req.prompt_text, req.prompt_ids = _prompt(body)
    return req


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
