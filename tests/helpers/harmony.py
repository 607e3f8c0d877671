"""A harmony-format chat template written for the tests (system and developer messages,
tools as a `functions` namespace, assistant turns on the analysis / commentary / final
channels, tool results from `functions.NAME`), and the special tokens gpt-oss's
tokenizer has for the format, so that a tiny tokenizer can carry them. Not OpenAI's own
template: the parser is tested on what this renders, which follows the format's spec."""
from __future__ import annotations

from pathlib import Path

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>"]
GENERATION_PROMPT = "<|start|>assistant"

TEMPLATE = """<|start|>system<|message|>You are a helpful assistant.
Reasoning: {{ reasoning_effort | default("medium") }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}

Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- set system = messages | selectattr("role", "equalto", "system") | list %}
{%- if system or tools %}<|start|>developer<|message|>
{%- if system %}# Instructions

{{ system[0].content }}
{%- endif %}
{%- if tools %}

# Tools

## functions

namespace functions {
{%- for t in tools %}

// {{ t.function.description | default("") }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{%- endfor %}

} // namespace functions
{%- endif %}<|end|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == "user" %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" %}
{%- if m.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>
{%- endif %}
{%- for c in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments }}<|call|>
{%- endfor %}
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- elif m.role == "tool" %}<|start|>functions.{{ m.name | default("tool") }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def add_harmony_tokens(tokenizer_json: Path) -> int:
    """Give a tokenizer.json harmony's special tokens; the new vocabulary size."""
    from tokenizers import AddedToken, Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(tokenizer_json))
    return tok.get_vocab_size()


def assistant_output(render, messages: list[dict], answer: dict) -> str:
    """What the model would write after the generation prompt to give `answer`: the
    rendering of the conversation with `answer` appended, past the prompt's."""
    prompt = render(messages)
    full = render(messages + [answer])
    assert prompt.endswith(GENERATION_PROMPT) and full.endswith(GENERATION_PROMPT)
    head = prompt[:-len(GENERATION_PROMPT)]
    assert full.startswith(head + GENERATION_PROMPT)
    return full[len(head) + len(GENERATION_PROMPT):-len(GENERATION_PROMPT)]
