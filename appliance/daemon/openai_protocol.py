"""OpenAI request parsing and response shapes. Pure functions: no aiohttp, no workers.

Every rejection is an `ApiError` carrying the HTTP status and OpenAI's error body
fields, so the HTTP layer turns all of them into the same JSON shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from appliance.daemon.api_error import ApiError, bad
from appliance.daemon.structured import parse_guided
from appliance.daemon.tool_calls import ToolRequest, message_fields, parse_tools
from appliance.engines.messages import GuidedDecoding, SamplingParams

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20       # OpenAI's chat bound; completions' is 5 there, 20 here
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 16
# Parameters that would change the output and are not implemented: refused, never
# ignored. Each maps to the value that means "off", which is accepted.
_UNSUPPORTED_UNLESS = {"suffix": None, "use_beam_search": False, "length_penalty": 1.0,
                       "prompt_logprobs": None, "guided_decoding_backend": None,
                       "truncate_prompt_tokens": None, "bad_words": None,
                       "allowed_token_ids": None, "spaces_between_special_tokens": True}
MAX_STOP_TOKEN_IDS = 64
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


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


def _number(body: dict, key: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{key}' must be a number", key, "invalid_type")
    if value < lo or value > hi or (lo_open and value == lo):
        span = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad(f"'{key}' must be in {span}, got {value}", key)
    return float(value)


def _int(body: dict, key: str, lo: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{key}' must be an integer", key, "invalid_type")
    if lo is not None and value < lo:
        raise bad(f"'{key}' must be at least {lo}, got {value}", key)
    return value


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a JSON string key) to a bias in [-100, 100]. Ids beyond
    the vocabulary are refused by `completion.check_token_ids`, which knows it."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad("'logit_bias' must be an object of token id -> bias", "logit_bias",
                  "invalid_type")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"'logit_bias' takes at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or str(token) != str(key).strip():
            raise bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}",
                      "logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))


def _logprobs(body: dict, endpoint: str) -> int | None:
    """Chat: logprobs=true and top_logprobs=k. Completions: logprobs=k."""
    if endpoint == "chat":
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise bad("'logprobs' must be true or false", "logprobs", "invalid_type")
        top = _int(body, "top_logprobs", 0)
        if top is not None and not on:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if not on:
            return None
        k = top or 0
        param = "top_logprobs"
    else:
        k = _int(body, "logprobs", 0)
        if k is None:
            return None
        param = "logprobs"
    if k > MAX_TOP_LOGPROBS:
        raise bad(f"'{param}' must be at most {MAX_TOP_LOGPROBS}, got {k}", param)
    return k


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{key}' must be true or false", key, "invalid_type")
    return value


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    """Ids beyond the vocabulary are refused by `completion.check_token_ids`."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids",
                  "invalid_type")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    return tuple(sorted(set(ids)))


def _priority(body: dict) -> int | None:
    """vLLM's scheduling class (lower first). A request may lower its standing below its
    tenant's class, not raise it (`daemon.fairness`)."""
    value = _int(body, "priority")
    if value is not None and not -(1 << 31) <= value < 1 << 31:
        raise bad("'priority' must fit in 32 bits", "priority")
    return value


def _seed(body: dict) -> int | None:
    seed = _int(body, "seed")
    if seed is not None and not -(1 << 63) <= seed < 1 << 64:
        raise bad("'seed' must fit in 64 bits", "seed")
    return seed


def _top_k(body: dict) -> int:
    k = _int(body, "top_k")
    if k is None or k == -1:            # vLLM's "off"
        return 0
    if k < 0:
        raise bad(f"'top_k' must be -1 or 0 (off) or a positive count, got {k}", "top_k")
    return k


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return stop


def _content_text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise bad(f"messages[{index}].content: only text parts are supported",
                          f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{index}].content must be a string or a list of text parts",
              f"messages[{index}].content", "invalid_type")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages", "missing_required_parameter"
                  if messages is None else "invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}",
                      f"messages[{i}].role")
        out.append({"role": role, "content": _content_text(m.get("content"), i),
                    **message_fields(m, i)})
    return out


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]           # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("only one prompt per request is supported", "prompt")
    raise bad("'prompt' must be a string, a list of one string, or a list of token ids",
              "prompt", "invalid_type")


def parse_body(raw: bytes, endpoint: str) -> GenerationRequest:
    """A request body as bytes -> the request (or the 400 that says what is wrong)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad(f"malformed JSON body: {exc}", None, "invalid_json") from None
    return parse_request(body, endpoint)


def parse_request(body, endpoint: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model", "missing_required_parameter")
    n = _int(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise bad(f"'n' must be at most {MAX_CHOICES}, got {n}", "n")
    for unsupported, off in _UNSUPPORTED_UNLESS.items():
        value = body.get(unsupported)
        if value is None or value == off or (off is None and not value):   # [] or "" = none
            continue
        raise bad(f"'{unsupported}' is not supported", unsupported, "unsupported_parameter")
    guided = parse_guided(body)
    best_of = _int(body, "best_of", 1)
    if best_of not in (None, n):
        raise bad("'best_of' other than n is not supported", "best_of",
                  "unsupported_parameter")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream", "invalid_type")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad("'stream_options' is only allowed with stream=true", "stream_options")
        include_usage = bool(opts.get("include_usage", False))
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise bad("'echo' must be true or false", "echo", "invalid_type")
    if echo and endpoint == "chat":
        raise bad("'echo' is not supported", "echo", "unsupported_parameter")
    max_tokens = _int(body, "max_completion_tokens", 1)
    legacy = _int(body, "max_tokens", 0 if echo else 1)   # 0 with echo: score the prompt
    if max_tokens is None:
        max_tokens = legacy
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("'ignore_eos' must be true or false", "ignore_eos", "invalid_type")
    if ignore_eos and guided is not None:
        raise bad("'ignore_eos' cannot be combined with a structured output: the grammar "
                  "ends the output", "ignore_eos")
    req = GenerationRequest(
        endpoint=endpoint, model=model, stream=stream, include_usage=include_usage,
        max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=_seed(body),
        stop=_stop(body), ignore_eos=ignore_eos, top_k=_top_k(body),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body), logprobs=_logprobs(body, endpoint), echo=echo, n=n,
        guided=guided, min_tokens=_int(body, "min_tokens", 0) or 0,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0), stop_token_ids=_stop_token_ids(body),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
        priority=_priority(body))
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad(f"'min_tokens' ({req.min_tokens}) must not exceed max_tokens "
                  f"({req.max_tokens})", "min_tokens")
    if endpoint == "chat":
        req.messages = _messages(body)
        req.tools = parse_tools(body)
    else:
        for name in ("tools", "functions", "tool_choice"):
            if body.get(name):
                raise bad(f"'{name}' is not supported on completions; use "
                          "/v1/chat/completions", name, "unsupported_parameter")
        req.prompt_text, req.prompt_ids = _prompt(body)
    return req


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
