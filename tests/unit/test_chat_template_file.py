"""A chat template kept only in `chat_template.jinja` beside the checkpoint (as
transformers saves it) is the one the daemon renders, equal to transformers'
`apply_chat_template`; `tokenizer_config.json`'s key is still read when it is the only
one, and the file wins when both are there, as in transformers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from helpers.harmony import TEMPLATE as HARMONY

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def _saved(tiny_model: Path, out: Path, template: str | None = None) -> Path:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("template", ["tiny", "harmony"])
def test_template_only_in_chat_template_jinja_renders_as_transformers(tiny_model, tmp_path,
                                                                      template):
    out = _saved(tiny_model, tmp_path / "ckpt", None if template == "tiny" else HARMONY)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (out / "chat_template.jinja").is_file() and "chat_template" not in cfg
    ref = transformers.AutoTokenizer.from_pretrained(out)
    ours = ServedTokenizer(out)
    for tools in (None, TOOLS):
        want = ref.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
        assert ours.render_chat(MESSAGES, tools) == want
    assert ours.tool_parser == ("harmony" if template == "harmony" else "hermes")


def test_the_jinja_file_wins_over_the_json_key(tiny_model, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_model, out)
    (out / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")
    assert ServedTokenizer(out).render_chat([{"role": "user", "content": "x"}]) == "FILE x"
    ref = transformers.AutoTokenizer.from_pretrained(out)
    assert ref.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "FILE x"


def test_tokenizer_config_key_alone_still_renders(tiny_model, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_model, out)
    assert not (out / "chat_template.jinja").exists()
    ref = transformers.AutoTokenizer.from_pretrained(out)
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ServedTokenizer(out).render_chat(MESSAGES) == want


def test_named_tool_use_template_is_taken_for_requests_with_tools(tiny_model, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_model, out)
    (out / "chat_template.jinja").write_text("DEFAULT {{ messages[0].content }}")
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "tool_use.jinja").write_text(
        "TOOLS {{ tools | length }}<tool_call>")
    ours = ServedTokenizer(out)
    ref = transformers.AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.render_chat(msgs, TOOLS) == "TOOLS 1<tool_call>" == ref.apply_chat_template(
        msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(msgs) == "DEFAULT hi" == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
