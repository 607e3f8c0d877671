"""The CLI and the config file: contracts, and one-line errors instead of tracebacks."""
from __future__ import annotations

import pytest

from appliance import config
from appliance.daemon.tokenizer import ServedTokenizer, StopMatcher


def test_config_defaults_and_types():
    cfg = config.parse("[engine]\nsim_speed = 3\n")
    assert cfg.engine.sim_speed == 3.0 and isinstance(cfg.engine.sim_speed, float)
    assert cfg.server.host == "127.0.0.1" and cfg.devices.mode == "disagg"
    with pytest.raises(config.ConfigError, match="server.port must be"):
        config.parse("[server]\nport = true\n")
    assert cfg.server.prepare_inline_bytes == 4096
    with pytest.raises(config.ConfigError, match="prepare_inline_bytes must be within 0..65536"):
        config.parse("[server]\nprepare_inline_bytes = 1000000\n")


def test_state_dir_resolution(monkeypatch, tmp_path):
    cfg = config.Config()
    assert config.state_dir(cfg, str(tmp_path)) == tmp_path
    cfg.state_dir = "/srv/appliance"
    assert str(config.state_dir(cfg)) == "/srv/appliance"


def test_stop_matcher_across_chunks():
    m = StopMatcher(["END", "\n\n"])
    out = []
    for piece in ["abc E", "N", "D tail"]:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "abc " and hit
    m = StopMatcher(["END"])
    assert m.feed("xE") == ("x", False)        # 'E' held back: it may start END
    assert m.feed("Nope") == ("ENope", False)  # it did not
    assert m.flush() == ""


def test_incremental_detokenizer_matches_full_decode(tiny_model):
    tok = ServedTokenizer(tiny_model)
    text = "naïve café — 日本語 🎉 def f(x): return x"
    ids = tok.encode(text)
    stream = tok.stream()
    assert "".join(stream.push([i]) for i in ids) == tok.decode(ids)
    # Every prefix, including ones that end inside a multi-byte character: what streams
    # out plus the final flush is exactly the full decode.
    for n in range(1, len(ids) + 1):
        stream = tok.stream()
        streamed = "".join(stream.push([i]) for i in ids[:n]) + stream.flush()
        assert streamed == tok.decode(ids[:n]), n


def test_chat_template_renders_roles(tiny_model):
    tok = ServedTokenizer(tiny_model)
    rendered = tok.render_chat([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"}])
    assert "system" in rendered and "Be brief." in rendered and "Hi" in rendered
    assert rendered.rstrip().endswith("assistant<|end_header_id|>")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(tok.tok.token_to_id("<|begin_of_text|>")) == 1


def test_manual_config_block_is_every_key_at_its_default():
    """The manual's configuration block (docs/configuration.md) is the documentation of
    every key: it must parse, name every key there is, and show each one's real default."""
    import dataclasses
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    block = re.search(r"```toml\n(.*?)```", page, re.S).group(1)
    parsed = config.parse(block, "docs/configuration.md")
    defaults = config.Config()
    for group in dataclasses.fields(defaults):
        want, got = getattr(defaults, group.name), getattr(parsed, group.name)
        if not dataclasses.is_dataclass(want):
            assert got == want, group.name
            continue
        for f in dataclasses.fields(want):
            if group.name == "auth":
                continue      # the example's keys are commented out
            assert re.search(rf"^{f.name} = ", block.split(f"[{group.name}]")[1], re.M), \
                f"docs/configuration.md lacks {group.name}.{f.name}"
            assert getattr(got, f.name) == getattr(want, f.name), f"{group.name}.{f.name}"
