"""One OpenAI generation request in flight: its prompt, its choices, and the response
shapes (whole, or as SSE chunks). No aiohttp here: openai_routes.py moves the bytes.

Each of a request's `n` choices is an engine request of its own (ids `R`, `R.1`, `R.2`…;
seeds `seed`, `seed + 1`… so choice 0 is what n = 1 gives), running concurrently once
choice 0's prompt is prefilled, so that the others take its blocks from the prefix cache.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AsyncIterator

import orjson

from appliance.accounting.records import RequestRecord
from appliance.daemon.openai_protocol import ApiError, GenerationRequest, bad, usage
from appliance.daemon.reasoning import ThinkParser, opens_thinking
from appliance.daemon.router import Trace
from appliance.daemon.tokenizer import PromptTooLong, ServedTokenizer, StopMatcher
from appliance.daemon.tool_calls import call_deltas, forced_grammar, new_parser

if TYPE_CHECKING:
    from appliance.daemon.service import Service

_END = object()
# Normalizers (NFC and the like) can shorten a text before it is tokenized; the cost bound
# allows for text that shrinks to half its characters.
NORMALIZED_SHRINK = 2
THINKING_TAIL = 4       # prompt tokens read to see whether the template opened <think>


def check_token_ids(req: GenerationRequest, vocab_size: int) -> None:
    """Every token id a request names must be in the served vocabulary. Checked here,
    once, for every engine (the simulator has no vocabulary of its own to check against);
    engines check only what they themselves cannot do."""
    if req.prompt_ids is not None and any(t < 0 or t >= vocab_size for t in req.prompt_ids):
        raise bad(f"token ids must be within [0, {vocab_size})", "prompt")
    beyond = [t for t in req.stop_token_ids if t >= vocab_size]
    if beyond:
        raise bad(f"stop_token_ids names token id {beyond[0]}, outside the vocabulary "
                  f"[0, {vocab_size})", "stop_token_ids")
    outside = [t for t, _ in req.logit_bias if not 0 <= t < vocab_size]
    if outside:
        raise bad(f"logit_bias names token id {outside[0]}, outside the vocabulary "
                  f"[0, {vocab_size})", "logit_bias")


def prompt_cost_bound(req: GenerationRequest, max_token_chars: int, max_context: int) -> None:
    """Refuse, before templating or tokenizing, a prompt that cannot fit the context:
    every message of a chat becomes at least one token, and no token stands for more
    than `max_token_chars` characters. Cheap (a sum of lengths), exact (never refuses a
    prompt that would fit), and it keeps a 1 MB body from costing a second of CPU when
    the model's context is small."""
    param = "messages" if req.endpoint == "chat" else "prompt"
    if req.endpoint == "chat":
        if len(req.messages) > max_context:
            raise bad(f"{len(req.messages)} messages cannot fit this model's context of "
                      f"{max_context} tokens", param, "context_length_exceeded")
        chars = sum(len(m.get("content") or "") for m in req.messages)
    elif req.prompt_text is not None:
        chars = len(req.prompt_text)
    else:
        return
    at_least = chars // (max_token_chars * NORMALIZED_SHRINK)
    if at_least > max_context:
        raise bad(f"the prompt has {chars} characters, at least {at_least} tokens; this "
                  f"model's context is {max_context}", param, "context_length_exceeded")


def prepare_prompt(tok: ServedTokenizer, req: GenerationRequest, model_name: str,
                   max_context: int) -> tuple[list[int], int]:
    """(prompt token ids, max_tokens) of a request, or the ApiError that refuses it.
    CPU-heavy for big prompts (~0.5-1 s for 1 MB of text); prompts that cannot fit the
    context whatever they tokenize to are refused before any tokenizing."""
    if req.model != model_name:
        raise ApiError(404, f"model '{req.model}' does not exist (this appliance serves "
                            f"'{model_name}')", "model", "model_not_found")
    param = "messages" if req.endpoint == "chat" else "prompt"
    check_token_ids(req, tok.vocab_size)
    prompt_cost_bound(req, tok.max_token_chars, max_context)
    tools = req.tools.tools if req.tools is not None and req.tools.active else None
    if tools and tok.tool_parser is None:
        raise bad("this model's chat template does not render tools, so it cannot call "
                  "them", "tools")
    if req.tools is not None and req.tools.forced:
        if req.guided is not None:
            raise bad("a forced 'tool_choice' cannot be combined with a structured output",
                      "tool_choice")
        from appliance.daemon.structured import check_constraint
        req.guided = check_constraint(forced_grammar(tok.tool_parser, req.tools), "tools")
    try:
        if req.endpoint == "chat":
            try:
                prompt = tok.encode_chat(req.messages, limit=max_context, tools=tools,
                                         kwargs=req.chat_template_kwargs)
                # A template that opens the <think> block itself leaves the model in it
                # (unless a grammar decides the output: then it writes what that says).
                # Only a reasoning model's output is split by it: no decode for others.
                req.thinking = (req.guided is None and tok.reasoning_parser is not None
                                and opens_thinking(tok.tok.decode(prompt[-THINKING_TAIL:],
                                                                  skip_special_tokens=False)))
            except PromptTooLong:
                raise
            except ValueError as exc:       # ChatTemplateError and the like
                raise bad(f"cannot apply the chat template: {exc}", "messages") from None
        elif req.prompt_ids is not None:
            prompt = list(req.prompt_ids)
        else:
            prompt = tok.encode(req.prompt_text, limit=max_context)
    except PromptTooLong as exc:
        raise bad(f"the prompt has {exc.tokens} tokens; this model's context is "
                  f"{max_context}", param, "context_length_exceeded") from None
    room = max_context - len(prompt)
    if room < 1:
        raise bad(f"the prompt has {len(prompt)} tokens; this model's context is "
                  f"{max_context}", param, "context_length_exceeded")
    if req.max_tokens is not None and req.max_tokens > room:
        raise bad(f"max_tokens {req.max_tokens} + prompt {len(prompt)} tokens exceed "
                  f"this model's context of {max_context}", "max_tokens",
                  "context_length_exceeded")
    return prompt, req.max_tokens if req.max_tokens is not None else room


class Choice:
    """One of the request's answers: its own engine request, text and finish reason."""

    def __init__(self, comp: Completion, index: int):
        # No reference back to `comp`: a Completion <-> Choice cycle kept every finished
        # request (its prompt ids, ~40 KB for 1,500 words) alive until a collection of
        # the generation it had reached, which the daemon's tuned collector runs rarely:
        # its memory grew with every request. `run` and `prompt_entries` take it instead.
        self.index = index
        rid = comp.request_id if index == 0 else f"{comp.request_id}.{index}"
        self.trace = Trace(rid, comp.arrival)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        tools = comp.req.tools
        family = comp.svc.tokenizer.tool_parser
        active = tools is not None and tools.active
        # Streamed output goes through the tool-call parser of the model's family; a
        # harmony model's chat output always does, for its channels (reasoning, answer).
        self.harmony = family == "harmony" and comp.req.endpoint == "chat"
        self.parser = (new_parser(family, tools.names if active else [], tools=active)
                       if family and (active or self.harmony) else None)
        # A reasoning model's output is split first: its thinking, then the answer
        # (which the tool-call parser reads, if any). Chat only, as vLLM.
        if comp.svc.tokenizer.reasoning_parser and comp.req.endpoint == "chat":
            self.parser = ThinkParser(self.parser, comp.req.thinking)

    async def run(self, comp: Completion) -> AsyncIterator[tuple[str, list]]:
        """Yield (text delta, logprob entries) until this choice finishes; sets
        finish_reason and counts. Entries are (token id, TokenLogprob) of the tokens
        behind the text, when the request asked for logprobs (else always empty)."""
        req = comp.req
        # Harmony's channels are special tokens: its parser reads them, the client never.
        detok = comp.svc.tokenizer.stream(req.skip_special_tokens and not self.harmony)
        stops = StopMatcher(req.stop)
        # max_tokens 0 (echo only): the engine still runs the prompt, for its logprobs,
        # and the one token it samples is dropped.
        params = req.sampling(max(1, comp.max_tokens), choice=self.index)
        gen = comp.svc.router.generate(self.trace, comp.prompt, params, comp.tenant,
                                       req.priority)
        pending: list = []
        echoing = req.echo
        try:
            async for tokens, reason, lps in gen:
                if echoing:
                    echoing = False
                    yield comp.prompt_text(), self.prompt_entries(comp)
                    if comp.max_tokens == 0:
                        self.finish_reason = "length"
                        return
                self.completion_tokens += len(tokens)
                if lps is None:
                    pieces = [(tokens, reason)]
                else:   # one token at a time: a stop string cuts the entries where it ends
                    pieces = [([t], reason if i == len(tokens) - 1 else None)
                              for i, t in enumerate(tokens)]
                    lps = iter(zip(tokens, lps))
                for ids, why in pieces:
                    if lps is not None:
                        pending.append(next(lps))
                    piece = detok.push(ids)
                    if why is not None:
                        piece += detok.flush()
                    text, hit = stops.feed(piece)
                    if hit:
                        self.finish_reason = "stop"
                        if req.include_stop_str_in_output:
                            text += stops.matched
                        if text or pending:
                            yield text, pending
                        return
                    if why is not None:
                        self.finish_reason = why
                        text += stops.flush()
                    if text or (why is not None and pending):
                        yield text, pending
                        pending = []
                    if why is not None:
                        return
        finally:
            await gen.aclose()

    def prompt_entries(self, comp: Completion) -> list:
        """(token id, TokenLogprob or None) for the echoed prompt, when logprobs were asked."""
        lps = self.trace.prompt_logprobs
        if comp.req.logprobs is None or lps is None:
            return []
        return list(zip(comp.prompt, lps))


class Completion:
    """One generation request in flight: tokens in, text and usage out."""

    def __init__(self, svc: "Service", req: GenerationRequest, tenant: str,
                 request_id: str | None = None, arrival: float | None = None):
        self.svc = svc
        self.req = req
        self.tenant = tenant
        self.request_id = request_id or svc.next_request_id()
        self.arrival = arrival or time.time()
        self.created = int(self.arrival)
        self.prompt: list[int] = []
        self.max_tokens = 0
        self.choices = [Choice(self, i) for i in range(req.n)]
        self.status = "error"
        self.error: str | None = None

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.req.endpoint == "chat" else "cmpl-") + self.request_id

    def prepare(self) -> None:
        """Validate against the model and tokenize, here (the daemon does this in its
        `PreparePool` instead, off the event loop, and sets `prompt` and `max_tokens`)."""
        self.prompt, self.max_tokens = prepare_prompt(
            self.svc.tokenizer, self.req, self.svc.model_name, self.svc.max_context)

    async def run(self) -> AsyncIterator[tuple[int, str, list]]:
        """Yield (choice index, text delta, logprob entries) from all choices as they
        come. The first failure ends the request; leaving early aborts every choice.

        The other choices start once choice 0 has sent something, that is once its
        prompt is prefilled and its full blocks are in the prefix cache: they then
        compute only the prompt's last partial block, not n copies of the prompt (on
        the same prefill worker; the router does not yet route by prefix)."""
        if len(self.choices) == 1:
            async for text, lps in self.choices[0].run(self):
                yield 0, text, lps
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for text, lps in choice.run(self):
                    queue.put_nowait((choice.index, text, lps))
            except Exception as exc:    # (cancellation passes: nobody is listening)
                queue.put_nowait((choice.index, exc, None))
            else:
                queue.put_nowait((choice.index, _END, None))

        tasks = [asyncio.create_task(pump(self.choices[0]))]
        try:
            live = len(self.choices)
            while live:
                index, text, lps = await queue.get()
                if len(tasks) == 1:
                    tasks += [asyncio.create_task(pump(c)) for c in self.choices[1:]]
                if text is _END:
                    live -= 1
                elif isinstance(text, Exception):
                    try:
                        raise text
                    finally:    # the traceback holds this frame: no cycle through it
                        text = None
                else:
                    yield index, text, lps
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def prompt_text(self) -> str:
        req = self.req
        return req.prompt_text if req.prompt_text is not None else self.svc.tokenizer.decode(
            self.prompt)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict:
        # The prompt counts once, as OpenAI counts it for n > 1.
        cached = max(c.trace.cached_tokens for c in self.choices)
        return usage(len(self.prompt), self.completion_tokens, cached)

    def record(self) -> RequestRecord:
        first = self.choices[0]
        t = first.trace
        starts = [c.trace.first_token for c in self.choices if c.trace.first_token is not None]
        return RequestRecord(
            request_id=self.request_id, tenant=self.tenant, model=self.svc.model_name,
            endpoint=self.req.endpoint, prompt_tokens=len(self.prompt),
            output_tokens=self.completion_tokens,
            cached_tokens=max(c.trace.cached_tokens for c in self.choices),
            arrival=self.arrival, first_token=min(starts) if starts else None,
            finish=time.time(), prefill_worker=t.prefill_worker, decode_worker=t.decode_worker,
            status=self.status, finish_reason=first.finish_reason, error=self.error,
            simulated=self.svc.simulated, choices=len(self.choices),
            structured=self.req.guided is not None, simulated_ttft_s=t.simulated_ttft)

    # ---- logprobs ------------------------------------------------------------
    def logprob_entries(self, entries: list) -> list[dict]:
        """OpenAI chat shape: each token's own text, its bytes, logprob and alternatives.
        A token's text is decoded alone, so a piece of a multi-byte character shows as
        U+FFFD (with those bytes), as in vLLM; with `return_tokens_as_token_ids` each
        token is named "token_id:N" instead, which says exactly which token it was."""
        decode = self.svc.tokenizer.decode
        if self.req.tokens_as_ids:
            def decode(ids: list[int]) -> str:
                return f"token_id:{ids[0]}"

        def one(token: int, logprob: float | None) -> dict:
            text = decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        out = []
        for token, scored in entries:
            if scored is None:      # an echoed prompt's first token: nothing predicts it
                out.append({**one(token, None), "top_logprobs": None})
            else:
                lp, alts = scored
                out.append({**one(token, lp), "top_logprobs": [one(t, v) for t, v in alts]})
        return out

    def completion_logprobs(self, entries: list, offset: int) -> dict:
        """The legacy completions shape; text offsets count from the completion's start."""
        chat = self.logprob_entries(entries)
        offsets = []
        for e in chat:
            offsets.append(offset)
            offset += len(e["token"])
        return {"tokens": [e["token"] for e in chat],
                "token_logprobs": [e["logprob"] for e in chat],
                "top_logprobs": [None if e["top_logprobs"] is None else
                                 {a["token"]: a["logprob"] for a in e["top_logprobs"]}
                                 for e in chat],
                "text_offset": offsets}

    def logprobs(self, entries: list, offset: int = 0) -> dict | None:
        if self.req.logprobs is None:
            return None
        if self.req.endpoint == "chat":
            return {"content": self.logprob_entries(entries), "refusal": None}
        return self.completion_logprobs(entries, offset)

    # ---- response shapes ---------------------------------------------------
    def chunk(self, index: int, text: str | None, finish: str | None, first: bool = False,
              logprobs: dict | None = None) -> bytes:
        if self.choices[index].parser is not None:
            return self._tool_chunks(index, text, finish, first, logprobs)
        if self.req.endpoint == "chat":
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
            obj = "text_completion"
        return b"data: " + orjson.dumps({
            "id": self.object_id, "object": obj, "created": self.created,
            "model": self.svc.model_name, "choices": [choice],
            "simulated": self.svc.simulated}) + b"\n\n"

    def _event(self, index: int, delta: dict, finish: str | None,
               logprobs: dict | None = None) -> bytes:
        return b"data: " + orjson.dumps({
            "id": self.object_id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.svc.model_name,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}],
            "simulated": self.svc.simulated}) + b"\n\n"

    def _tool_chunks(self, index: int, text: str | None, finish: str | None, first: bool,
                     logprobs: dict | None) -> bytes:
        """A chat choice with tools: content as it comes (held back where it may be the
        start of a call), each call as OpenAI streams it once it is complete, and
        finish_reason "tool_calls" when the answer was calls."""
        choice = self.choices[index]
        parser = choice.parser
        content, calls = parser.feed(text) if text else ("", [])
        if finish is not None:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
            if parser.calls and finish == "stop":
                finish = choice.finish_reason = "tool_calls"
        reasoning = parser.take_reasoning()
        out = b""
        if reasoning:
            delta = {"role": "assistant"} if first else {}
            delta["reasoning_content"] = reasoning
            out += self._event(index, delta, None)
            first = False
        if first or content or logprobs is not None:
            delta: dict = {"role": "assistant"} if first else {}
            delta["content"] = content
            out += self._event(index, delta, None, logprobs)
        first_index = parser.calls_sent - len(calls)
        if self.req.tools is not None and not self.req.tools.parallel:     # the first only
            calls = calls[:max(0, 1 - first_index)]
        for d in call_deltas(calls, first_index):
            out += self._event(index, {"tool_calls": [d]}, None)
        if finish is not None:
            out += self._event(index, {}, finish)
        return out

    def usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.req.endpoint == "chat" else "text_completion"
        return b"data: " + orjson.dumps({
            "id": self.object_id, "object": obj, "created": self.created,
            "model": self.svc.model_name, "choices": [], "usage": self.usage(),
            "simulated": self.svc.simulated}) + b"\n\n"

    def full(self, texts: list[str], entries: list[list]) -> dict:
        choices = []
        for c, text, lps in zip(self.choices, texts, entries):
            logprobs = self.logprobs(lps)
            if self.req.endpoint == "chat":
                message = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if c.parser is not None:
                    content, calls, reasoning = c.parser.split(text)
                    if self.req.tools is not None and not self.req.tools.parallel:
                        calls = calls[:1]
                    if calls:
                        message = {"role": "assistant", "content": content.strip() or None,
                                   "tool_calls": [call.openai() for call in calls]}
                        if finish == "stop":
                            finish = c.finish_reason = "tool_calls"
                    else:       # the answer without its thinking and channels
                        message = {"role": "assistant", "content": content}
                    if reasoning:
                        message["reasoning_content"] = reasoning
                choices.append({"index": c.index, "message": message,
                                "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.req.endpoint == "chat" else "text_completion"
        return {"id": self.object_id, "object": obj, "created": self.created,
                "model": self.svc.model_name, "choices": choices, "usage": self.usage(),
                "system_fingerprint": self.svc.fingerprint, "simulated": self.svc.simulated}
