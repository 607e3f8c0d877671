"""Tool calling: the request's `tools` and `tool_choice`, the history's calls and results,
and the model's output turned back into OpenAI `tool_calls`.

Models call tools in their family's own text format, which the chat template teaches
them; a parser per family reads it back:
- "hermes": `<tool_call>{"name", "arguments"}</tool_call>` (Qwen 2.5/3, Hermes, the
  generated tiny model);
- "llama3_json": the whole answer is `{"name", "parameters"}` (Llama 3.1+; several joined
  by `;`), optionally after `<|python_tag|>`;
- "mistral": `[TOOL_CALLS][{"name", "arguments"}, ...]`;
- "harmony": OpenAI's harmony format (gpt-oss): messages on channels, `analysis` read
  back as `reasoning_content`, `final` as content, and a `commentary` message addressed
  `to=functions.NAME` as a call of NAME (see `HarmonyParser`).
The family comes from the chat template (what it tells the model to write) unless
configured. `tool_choice: "required"` or a named function is enforced by a grammar for
that format (the output must be one call of an allowed tool with arguments valid for
its schema; for harmony, one `commentary` message to `functions.NAME`), so even a
random-weights model returns a valid call.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from appliance.daemon.api_error import bad
from appliance.engines.messages import GuidedDecoding

PARSERS = ("hermes", "llama3_json", "mistral", "harmony")
MAX_TOOLS = 128
ARGUMENT_FRAGMENT = 24      # characters per streamed `arguments` delta


@dataclass(slots=True)
class ToolRequest:
    """The tools a request offers and how the model may use them."""

    tools: list[dict]                       # OpenAI shape: {"type": "function", "function"}
    choice: str = "auto"                    # "none" | "auto" | "required" | "named"
    name: str | None = None                 # the function, when choice == "named"
    parallel: bool = True
    names: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        """Whether tools are shown to the model and its output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice in ("required", "named")

    def schemas(self) -> list[tuple[str, dict]]:
        picked = [t["function"] for t in self.tools
                  if self.choice != "named" or t["function"]["name"] == self.name]
        return [(f["name"], f.get("parameters") or {"type": "object", "properties": {}})
                for f in picked]


_FUNCTION_NAME = {"type": "object", "required": ["name"],
                  "properties": {"name": {"type": "string"}}}
# The request fields this module reads, as JSON Schema (`api_schema.Body` checks a body
# against them; /openapi.json shows them); what a schema cannot say is checked below.
REQUEST_FIELDS = {
    "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS,
              "description": "The functions the model may call.",
              "items": {"type": "object", "required": ["type", "function"], "properties": {
                  "type": {"const": "function"},
                  "function": {"type": "object", "required": ["name"], "properties": {
                      "name": {"type": "string", "minLength": 1, "maxLength": 64},
                      "description": {"type": ["string", "null"]},
                      "parameters": {"type": ["object", "null"],
                                     "description": "the arguments' JSON Schema"},
                      "strict": {"type": ["boolean", "null"]}}}}}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]},
                              {"type": "object", "required": ["type", "function"],
                               "properties": {"type": {"const": "function"},
                                              "function": _FUNCTION_NAME}}],
                    "description": "none, auto (the default), required (a grammar forces one "
                                   "call), or a named function (forced likewise)."},
    "parallel_tool_calls": {"type": ["boolean", "null"]},
    "functions": {"description": "Deprecated by OpenAI and not supported: refused (use tools)."},
}
# What a chat message may carry beyond role and content (see `message_fields`).
MESSAGE_FIELDS = {
    "tool_calls": {"type": ["array", "null"], "description": "an assistant's calls",
                   "items": {"type": "object", "required": ["function"], "properties": {
                       "id": {"type": ["string", "null"]}, "type": {"const": "function"},
                       "function": {"type": "object", "required": ["name"], "properties": {
                           "name": {"type": "string"},
                           "arguments": {"type": ["string", "object"]}}}}}},
    "tool_call_id": {"type": ["string", "null"],
                     "description": "the call a tool message answers (required on those)"},
}
TOOL_MESSAGE_ROLES = ("system", "developer", "user", "assistant")
# Which role may carry them: a tool result names its call; only an assistant calls. As
# `anyOf` whose first branch is the common case (no exception raised inside the compiled
# check: fastjsonschema's failed branches cost ~50 µs each), not as if/then.
MESSAGE_RULES = [
    {"anyOf": [{"properties": {"role": {"enum": list(TOOL_MESSAGE_ROLES)}}},
               {"required": ["tool_call_id"],
                "properties": {"tool_call_id": {"type": "string", "minLength": 1}}},
               # an unknown role: left to the role's own check, which names it
               {"properties": {"role": {"not": {"enum": [*TOOL_MESSAGE_ROLES, "tool"]}}}}],
     "description": "a tool message needs its tool_call_id", "x-param": "tool_call_id"},
    {"anyOf": [{"properties": {"tool_calls": {"type": "null"}}},
               {"properties": {"tool_calls": {"maxItems": 0}}},
               {"properties": {"role": {"const": "assistant"}}}],
     "description": "only an assistant message carries tool_calls", "x-param": "tool_calls"},
]


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` (and the legacy `functions`, refused)
    -> the ToolRequest, or None when there are no tools; a 400 naming the field. The
    fields' shapes are already checked against `REQUEST_FIELDS`."""
    if body.get("functions"):
        raise bad("'functions' is deprecated and not supported; use 'tools'", "functions")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    names = []
    clean = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        name = fn["name"]
        if name in names:
            raise bad(f"tools[{i}]: function {name!r} is given twice", "tools")
        params = fn.get("parameters")
        names.append(name)
        out = {"name": name}
        if isinstance(fn.get("description"), str):
            out["description"] = fn["description"]
        out["parameters"] = params if params is not None else {"type": "object",
                                                                "properties": {}}
        clean.append({"type": "function", "function": out})
    req = ToolRequest(clean, parallel=parallel, names=names)
    if not isinstance(choice, dict):
        req.choice = choice or "auto"
    else:
        name = choice["function"]["name"]
        if name not in names:
            raise bad(f"'tool_choice' names function {name!r}, which is not in 'tools'",
                      "tool_choice")
        req.choice, req.name = "named", name
    return req


def message_fields(m: dict) -> dict:
    """What a history message carries beyond role and content: an assistant's
    `tool_calls` (arguments kept as the JSON text they were) and a tool result's
    `tool_call_id`, checked so a template never sees a malformed call."""
    out: dict = {}
    calls = m.get("tool_calls")
    if calls:                           # on an assistant message (MESSAGE_RULES)
        clean = []
        for call in calls:
            fn = call["function"]
            args = fn.get("arguments", "{}")
            if not isinstance(args, str):
                args = json.dumps(args)
            clean.append({"id": call.get("id") or "", "type": "function",
                          "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = clean
    if m["role"] == "tool":             # a non-empty string there (MESSAGE_RULES)
        out["tool_call_id"] = m["tool_call_id"]
    return out


def detect_parser(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None (no tools)."""
    if not template:
        return None
    if "<|channel|>" in template:       # harmony: the format is the whole answer's
        return "harmony"
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


# ---- forcing a call ----------------------------------------------------------------

def forced_grammar(parser: str, tools: ToolRequest) -> GuidedDecoding:
    """The grammar that makes the output one call, in `parser`'s format, of one of the
    allowed tools with arguments valid for its parameters."""
    if parser == "harmony":     # a commentary message to functions.NAME (grammar.py)
        return GuidedDecoding("harmony_call", json.dumps({"calls": tools.schemas()}))
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": name}, args_key: params},
                "required": ["name", args_key], "additionalProperties": False}
               for name, params in tools.schemas()]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    begin, end = {"hermes": ("<tool_call>\n", "\n</tool_call>"),
                  "llama3_json": ("", ""),
                  "mistral": ("[TOOL_CALLS][", "]")}[parser]
    return GuidedDecoding("tagged_json", json.dumps({"begin": begin, "schema": schema,
                                                      "end": end}))


# ---- reading calls back ---------------------------------------------------------------

@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str          # JSON text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, args_keys: tuple[str, ...], names: list[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names and obj["name"] not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _json_values(text: str) -> list:
    """Consecutive JSON values in text (separated by whitespace, `;` or `,`), or raise."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \n\t\r;,":
            i += 1
        if i >= len(text):
            return out
        value, i = dec.raw_decode(text, i)
        out.append(value)


class ToolParser:
    """One choice's output: content text and tool calls, whole or streamed."""

    start = ""              # where calls begin in the text (the family's marker)

    def __init__(self, names: list[str]):
        self.names = names
        self.buffer = ""
        self.content_sent = 0       # characters of buffer sent as content
        self.calls: list[ToolCall] = []
        self.calls_sent = 0
        self.in_calls = False

    # whole text -------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content before the calls, calls); no calls when the text holds none that
        parse: then all of it is content."""
        at = self._find_start(text)
        if at < 0:
            return text, []
        calls = self._calls(text[at:])
        if not calls:
            return text, []
        return text[:at], calls

    def _find_start(self, text: str) -> int:
        return text.find(self.start)

    def _calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    # streaming --------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content safe to send now, calls complete so far and not yet sent)."""
        self.buffer += text
        if not self.in_calls:
            at = self._find_start(self.buffer)
            if at >= 0:
                self.in_calls = True
                out = self.buffer[self.content_sent:at]
                self.content_sent = at
                return out, self._complete_calls()
            safe = self._safe_end()
            out = self.buffer[self.content_sent:safe]
            self.content_sent = safe
            return out, []
        return "", self._complete_calls()

    def _safe_end(self) -> int:
        """How much of a buffer without the start marker may go out as content: all but
        a tail that could be the marker's beginning."""
        buf = self.buffer
        for k in range(min(len(self.start) - 1, len(buf)), 0, -1):
            if self.start.startswith(buf[-k:]):
                return len(buf) - k
        return len(buf)

    def _complete_calls(self) -> list[ToolCall]:
        return []

    def take_reasoning(self) -> str:
        """Reasoning text read since the last call (only harmony has a channel for it)."""
        return ""

    def split(self, text: str) -> tuple[str, list[ToolCall], str]:
        """A whole output: (content, calls, reasoning)."""
        content, calls = self.parse(text)
        return content, calls, ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: the rest of the content and the calls not sent.
        Text that looked like the start of calls but does not parse goes out as content."""
        content, calls = self.parse(self.buffer)
        if calls:
            rest = content[self.content_sent:]
            new = calls[self.calls_sent:]
            self.calls = self.calls[:self.calls_sent] + new
            self.calls_sent = len(self.calls)
            self.content_sent = max(self.content_sent, len(content))
            return rest, new
        if self.calls_sent:     # calls went out; what follows them does not parse
            return "", []
        rest = self.buffer[self.content_sent:]
        self.content_sent = len(self.buffer)
        return rest, []


class HermesParser(ToolParser):
    start = "<tool_call>"
    end = "</tool_call>"

    def _calls(self, text: str) -> list[ToolCall]:
        out = []
        for block in text.split(self.start)[1:]:
            body = block.split(self.end, 1)[0]
            try:
                values = _json_values(body)
            except ValueError:
                return []
            calls = [_call(v, ("arguments",), self.names) for v in values]
            if not calls or None in calls:
                return []
            out.extend(calls)
        return out

    def _complete_calls(self) -> list[ToolCall]:
        """Each `<tool_call>…</tool_call>` goes out as soon as it is closed."""
        done = self.buffer[self.content_sent:]
        closed = done.rfind(self.end)
        if closed < 0:
            return []
        calls = self._calls(done[:closed + len(self.end)])
        new = calls[self.calls_sent:]
        self.calls.extend(new)
        self.calls_sent += len(new)
        return new


class Llama3JsonParser(ToolParser):
    start = "{"
    tag = "<|python_tag|>"

    def _find_start(self, text: str) -> int:
        """Calls are the whole answer: a JSON object first (after the tag, if any)."""
        stripped = text.lstrip()
        if stripped.startswith(self.tag):
            stripped = stripped[len(self.tag):].lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1

    def _safe_end(self) -> int:
        stripped = self.buffer.lstrip()
        if not stripped or self.tag.startswith(stripped[:len(self.tag)]):
            return self.content_sent     # cannot tell yet
        return len(self.buffer)

    def _calls(self, text: str) -> list[ToolCall]:
        try:
            values = _json_values(text)
        except ValueError:
            return []
        calls = [_call(v, ("parameters", "arguments"), self.names) for v in values]
        return [] if not calls or None in calls else calls


class MistralParser(ToolParser):
    start = "[TOOL_CALLS]"

    def _calls(self, text: str) -> list[ToolCall]:
        try:
            values = _json_values(text[len(self.start):])
        except ValueError:
            return []
        flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
        calls = [_call(v, ("arguments",), self.names) for v in flat]
        return [] if not calls or None in calls else calls


class HarmonyParser(ToolParser):
    """OpenAI's harmony format, as gpt-oss writes it after the prompt's
    `<|start|>assistant`: messages of the form `<|channel|>CHANNEL[ to=RECIPIENT]
    [<|constrain|>json]<|message|>TEXT` closed by `<|end|>`, `<|call|>` or `<|return|>`,
    the next one opened by `<|start|>assistant`. The output must be decoded with its
    special tokens kept. `analysis` is the chain of thought: it goes to
    `reasoning_content`, as vLLM does for gpt-oss; `final` (and a `commentary` message
    to no one, a preamble meant for the user) is content; a message addressed
    `to=functions.NAME` is a call of NAME whose arguments are its text. Text that never
    opens a message (a model not following the format) is content, at the end.

    A state machine over the text rather than OpenAI's `openai-harmony` parser: that
    needs the o200k vocabulary file, fetched from the network on first use, and the
    daemon has the text already."""

    START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
    HEADER = (CHANNEL, MESSAGE, CONSTRAIN)
    LONGEST = 24                # a special token's text is shorter

    def __init__(self, names: list[str], tools: bool = True):
        super().__init__(names)
        self.tools = tools          # whether calls are read back (else their text is dropped)
        self.header = ""            # the current message's header, until <|message|>
        self.in_body = False
        self.channel = ""
        self.recipient = ""
        self.body = ""              # a call's arguments, until it closes
        self.content = ""
        self.reasoning = ""
        self.reasoning_sent = 0
        self.pending = ""           # text not yet read: may be the start of a marker

    # the state machine ---------------------------------------------------------
    def _read(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Advance over `text`; (content, calls) that it completes."""
        buf = self.pending + text
        content, calls = [], []
        i = 0
        while i < len(buf):
            at = buf.find("<|", i)
            if at < 0:
                # a trailing "<" may begin a marker: keep it for the next chunk
                end = len(buf) - 1 if buf.endswith("<") and not final else len(buf)
                self._text(buf[i:end], content)
                i = end
                break
            self._text(buf[i:at], content)
            i = at
            close = buf.find("|>", at, at + self.LONGEST)
            if close < 0:
                if len(buf) - at < self.LONGEST and not final:
                    break               # a marker cut by the chunk: wait for the rest
                self._text("<|", content)   # not a marker: text
                i = at + 2
                continue
            marker = buf[at:close + 2]
            i = close + 2
            if marker == self.MESSAGE and not self.in_body:
                self._open()
            elif marker in self.ENDS and self.in_body:
                call = self._close()
                if call is not None:
                    calls.append(call)
            elif marker == self.START:
                if self.in_body:        # an unclosed message: close it
                    call = self._close()
                    if call is not None:
                        calls.append(call)
                self.header = ""
            elif not self.in_body:
                self.header += marker
            elif (marker not in self.MARKERS and not self._special(marker)) or (
                    self.recipient and marker in self.HEADER):
                # In a call's arguments a header marker is text of the arguments (a
                # forced call's grammar read it so); only an end closes them.
                self._text(marker, content)
        self.pending = buf[i:]
        if final:
            if self.in_body:
                call = self._close()
                if call is not None:
                    calls.append(call)
            elif self.header.strip() and not self.calls and not self.content:
                # never a message: whatever the model wrote is the answer
                content.append(self._plain(self.header))
            self.header = ""
        out = "".join(content)
        self.content += out
        return out, calls

    @staticmethod
    def _special(marker: str) -> bool:
        """`<|word|>`: another special token (an end of text): never shown as text."""
        return marker[2:-2].replace("_", "").isalnum()

    @classmethod
    def _plain(cls, text: str) -> str:
        for m in cls.MARKERS:
            text = text.replace(m, "")
        return text

    def _text(self, text: str, content: list[str]) -> None:
        if not text:
            return
        if not self.in_body:
            self.header += text
        elif self.recipient:
            self.body += text
        elif self.channel == "analysis":
            self.reasoning += text
        else:                           # final, or a commentary preamble
            content.append(text)

    def _open(self) -> None:
        header = self.header
        channel = ""
        if self.CHANNEL in header:
            channel = header.split(self.CHANNEL, 1)[1].split(self.CONSTRAIN, 1)[0]
            channel = channel.split()[0] if channel.split() else ""
        recipient = next((w[3:] for w in header.replace(self.CONSTRAIN, " ").replace(
            self.CHANNEL, " ").split() if w.startswith("to=")), "")
        self.channel, self.recipient = channel, recipient
        self.in_body, self.header, self.body = True, "", ""

    def _close(self) -> ToolCall | None:
        recipient, body = self.recipient, self.body.strip()
        self.in_body, self.channel, self.recipient, self.body = False, "", "", ""
        if not recipient or not self.tools:
            return None
        name = recipient.removeprefix("functions.")
        if self.names and name not in self.names:
            return None
        try:
            args = json.dumps(json.loads(body)) if body else "{}"
        except ValueError:
            args = body                 # as written: the client sees what the model said
        call = ToolCall(name, args)
        self.calls.append(call)
        self.calls_sent += 1
        return call

    # the ToolParser interface ----------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._read(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._read("", final=True)

    def take_reasoning(self) -> str:
        out = self.reasoning[self.reasoning_sent:]
        self.reasoning_sent = len(self.reasoning)
        return out

    def split(self, text: str) -> tuple[str, list[ToolCall], str]:
        fresh = HarmonyParser(self.names, self.tools)
        fresh._read(text)
        fresh._read("", final=True)
        return fresh.content, fresh.calls, fresh.reasoning

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        content, calls, _ = self.split(text)
        return content, calls


def new_parser(family: str, names: list[str], tools: bool = True) -> ToolParser:
    if family == "harmony":
        return HarmonyParser(names, tools)
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
            "mistral": MistralParser}[family](names)


def call_deltas(calls: list[ToolCall], first_index: int) -> list[dict]:
    """OpenAI's streamed shape: per call a delta with index, id, type and function.name
    (arguments ""), then the arguments in fragments."""
    out = []
    for k, call in enumerate(calls, first_index):
        out.append({"index": k, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}})
        args = call.arguments
        for a in range(0, len(args), ARGUMENT_FRAGMENT):
            out.append({"index": k, "function": {"arguments": args[a:a + ARGUMENT_FRAGMENT]}})
    return out
