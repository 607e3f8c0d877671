"""A Qwen3-style chat template (Qwen3's own, abridged: the system turn, tools as Hermes
signatures, `<think>` blocks, `<tool_call>` JSON, tool results as `<tool_response>` in a
user turn, and `enable_thinking: false` writing an empty thinking block into the
generation prompt) and the tokens Qwen3's tokenizer adds for it, so that the tiny
tokenizer can carry them. `<think>`, `</think>`, `<tool_call>`, `</tool_call>` are
added as non-special tokens, as in Qwen3's tokenizer (they stay in decoded text)."""
from __future__ import annotations

from pathlib import Path

SPECIAL = ["<|im_start|>", "<|im_end|>"]
PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
GENERATION_PROMPT = "<|im_start|>assistant\n"

TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content or '' %}
        {%- set reasoning_content = message.reasoning_content or '' %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if reasoning_content %}
            {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content.lstrip('\n') }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or (not loop.first) %}
                {{- '\n' }}
            {%- endif %}
            {%- set tool_call = tool_call.function %}
            {{- '<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Qwen3-2507's thinking models' template opens the block in the generation prompt.
OPEN_THINK_TEMPLATE = TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
    "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking")


def add_qwen3_tokens(tokenizer_json: Path) -> int:
    """Give a tokenizer.json Qwen3's chat and thinking tokens; the new vocabulary size."""
    from tokenizers import AddedToken, Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN])
    tok.save(str(tokenizer_json))
    return tok.get_vocab_size()


def qwen3_checkpoint_files(tiny_model: Path, out: Path, template: str = TEMPLATE) -> int:
    """The tiny model's tokenizer files in `out` with Qwen3's tokens and template
    (`<|im_end|>` as the end of a turn); the vocabulary size."""
    import json
    import shutil
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        shutil.copy(tiny_model / name, out / name)
    vocab = add_qwen3_tokens(out / "tokenizer.json")
    from tokenizers import Tokenizer
    im_end = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|im_end|>")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    cfg["eos_token"] = "<|im_end|>"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [im_end]
    (out / "generation_config.json").write_text(json.dumps(gen))
    return vocab


def assistant_output(render, messages: list[dict], answer: dict) -> str:
    """What the model writes after the generation prompt to give `answer`: the
    conversation rendered with `answer` appended, past the prompt, without `<|im_end|>`."""
    prompt = render(messages)
    full = render(messages + [answer])
    assert prompt.endswith(GENERATION_PROMPT)
    head = prompt[:-len(GENERATION_PROMPT)]
    assert full.startswith(head + GENERATION_PROMPT)
    body = full[len(head) + len(GENERATION_PROMPT):-len(GENERATION_PROMPT)]
    assert body.endswith("<|im_end|>\n")
    return body[:-len("<|im_end|>\n")]
