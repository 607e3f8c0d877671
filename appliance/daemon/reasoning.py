"""Reasoning models' thinking, split from their answer: `message.reasoning_content`.

Qwen3 (and QwQ, DeepSeek-R1 distills on Qwen's template) write their chain of thought
first, `<think>…</think>`, then the answer. As vLLM's `qwen3` reasoning parser does, the
text between the tags is returned as `reasoning_content` (`delta.reasoning_content` when
streaming) and the rest as `content`; an answer that does not open with `<think>` is all
content (Qwen3 with `enable_thinking: false`, whose template writes an empty
`<think>\\n\\n</think>` into the prompt). A template that opens the block itself (its
generation prompt ends with `<think>`, as Qwen3-2507's thinking models' do) leaves the
model inside it: then everything up to `</think>` is reasoning. A tool call after the
thinking is read by the model's tool-call parser from the answer.

Gpt-oss's reasoning is harmony's `analysis` channel, split by `tool_calls.HarmonyParser`.
The family is detected from the chat template unless `[engine] reasoning_parser` names
it (`detect_reasoning`).
"""
from __future__ import annotations

from appliance.daemon.tool_calls import ToolCall, ToolParser

REASONING_PARSERS = ("qwen3",)
THINK, END_THINK = "<think>", "</think>"


def detect_reasoning(template: str | None, tool_parser: str | None) -> str | None:
    """The reasoning format a chat template teaches, or None. Harmony templates carry
    their reasoning on a channel, which their own parser splits."""
    if not template or tool_parser == "harmony":
        return None
    if THINK in template and END_THINK in template:
        return "qwen3"
    return None


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt leaves the model inside a `<think>` block."""
    return prompt_tail.rstrip().endswith(THINK)


class ThinkParser:
    """One choice's output: `<think>` reasoning, then the answer, which goes on to the
    tool-call parser `inner` (None: all of it is content). Streamed pieces concatenate to
    the whole output's split: reasoning and answer without the whitespace around the tags
    (held back while it may still be trailing)."""

    def __init__(self, inner: ToolParser | None, thinking: bool = False):
        self.inner = inner
        # "start": not yet known whether the output opens a block; "think"; "answer"
        self.state = "think" if thinking else "start"
        self.thinking = thinking    # the prompt opened the block
        self.pending = ""           # text not yet placed
        self.reasoning = ""
        self.reasoning_sent = 0
        self.answer_started = False     # leading whitespace of the answer is dropped

    # what completion.py reads of a tool parser
    @property
    def calls(self) -> list[ToolCall]:
        return self.inner.calls if self.inner is not None else []

    @property
    def calls_sent(self) -> int:
        return self.inner.calls_sent if self.inner is not None else 0

    def _answer(self, text: str) -> tuple[str, list[ToolCall]]:
        if not self.answer_started:
            text = text.lstrip()
            if not text:
                return "", []
            self.answer_started = True
        if self.inner is None:
            return text, []
        return self.inner.feed(text)

    def _read(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        buf = self.pending + text
        self.pending = ""
        if self.state == "start":
            head = buf.lstrip()
            if head.startswith(THINK):
                self.state = "think"
                buf = head[len(THINK):]
            elif THINK.startswith(head) and not final:
                self.pending = buf          # may still become "<think>"
                return "", []
            else:
                self.state = "answer"
                self.answer_started = True      # no thinking: the answer as written
        if self.state == "think":
            end = buf.find(END_THINK)
            if end < 0:
                keep = 0 if final else _held(buf)
                thought = buf[:len(buf) - keep]
                self.pending = buf[len(buf) - keep:]
                self._think(thought, final)
                return "", []
            self._think(buf[:end], True)
            self.state = "answer"
            buf = buf[end + len(END_THINK):]
        return self._answer(buf)

    def _think(self, text: str, last: bool) -> None:
        if not self.reasoning:
            text = text.lstrip()
        if last:
            text = text.rstrip()
        self.reasoning += text

    # the ToolParser interface that completion.py uses ----------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._read(text, final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._read("", final=True)
        if self.inner is not None:
            rest, more = self.inner.finish()
            content, calls = content + rest, calls + more
        return content, calls

    def take_reasoning(self) -> str:
        out = self.reasoning[self.reasoning_sent:]
        self.reasoning_sent = len(self.reasoning)
        return out

    def split(self, text: str) -> tuple[str, list[ToolCall], str]:
        """A whole output: (content, calls, reasoning)."""
        fresh = ThinkParser(None, self.thinking)
        answer, _ = fresh._read(text, final=True)
        if self.inner is None:
            return answer, [], fresh.reasoning
        content, calls, _ = self.inner.split(answer)
        return content, calls, fresh.reasoning


def _held(buf: str) -> int:
    """How much of the end of a thought to hold back: trailing whitespace (dropped if
    `</think>` follows) and a tail that may be the start of `</think>`."""
    keep = 0
    for k in range(min(len(END_THINK) - 1, len(buf)), 0, -1):
        if END_THINK.startswith(buf[-k:]):
            keep = k
            break
    body = buf[:len(buf) - keep]
    return keep + (len(body) - len(body.rstrip()))
