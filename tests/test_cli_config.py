"""The CLI and the config file: contracts, and one-line errors instead of tracebacks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from appliance import config
from appliance.daemon.tokenizer import ServedTokenizer, StopMatcher
from conftest import ROOT


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def one_line_error(out: subprocess.CompletedProcess, needle: str) -> None:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert needle in lines[0], lines[0]


def test_devices_json_contract():
    out = cli("devices", "--devices", "sim:8xH100", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"id", "name", "kind", "simulated"} <= set(data["devices"][0])
    assert all(d["kind"] == "sim" and d["simulated"] for d in data["devices"])
    plan = data["plan"]
    assert plan["mode"] == "disagg"
    assert [len(plan["prefill"]), len(plan["decode"])] == [4, 4]
    assert {"worker", "devices"} == set(plan["prefill"][0])
    used = [d for g in ("prefill", "decode") for w in plan[g] for d in w["devices"]]
    assert sorted(used) == sorted(d["id"] for d in data["devices"])


def test_devices_human_output_marks_simulation():
    out = cli("devices", "--devices", "sim:2xA100-80GB", "--mode", "agg")
    assert out.returncode == 0, out.stderr
    assert "(simulated)" in out.stdout and "agg0" in out.stdout


@pytest.mark.parametrize("args,needle", [
    (("devices", "--devices", "sim:8xH100", "--split", "5+4"), "9"),
    (("devices", "--devices", "sim:8xH100", "--split", "4+0"), "decode"),
    (("devices", "--devices", "sim:8xH100", "--tp", "3"), "divisible"),
    (("devices", "--devices", "sim:8xZ999"), "Z999"),
    (("devices", "--devices", "sim:eight"), "sim:"),
])
def test_bad_devices_and_splits_are_one_line(args, needle):
    one_line_error(cli(*args), needle)


def test_status_without_daemon_is_one_line():
    one_line_error(cli("status", "--url", "http://127.0.0.1:9"), "no daemon at")


def test_version_and_key_digest():
    assert cli("version").stdout.startswith("applianced ")
    out = cli("key", "digest", "secret")
    assert out.stdout.strip() == "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"


def test_config_check(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[server]\nport = 9000\n[engine]\nsim_speed = 2\n[auth.keys]\n'
                    '"2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b" = "svc"\n')
    assert cli("config", "check", str(good)).returncode == 0
    for text, needle in [
        ("[server]\nprot = 9000\n", "unknown key server.prot"),
        ("[engine]\nblock_size = 'big'\n", "engine.block_size must be an integer"),
        ("[devices]\nmode = 'fast'\n", "devices.mode"),
        ("[server\n", "not valid TOML"),
        ("[auth.keys]\nsecret = 'svc'\n", "SHA-256"),
        ("[engine]\nreserve_ratio = 2.0\n", "reserve_ratio"),
        ("[engine]\nprefill_chunk_tokens = -1\n", "prefill_chunk_tokens must be 0 (off) or more"),
        ("[engine]\ncpu_threads = -2\n", "cpu_threads must be 0 (auto) or more"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        one_line_error(cli("config", "check", str(bad)), needle)
    one_line_error(cli("config", "check", str(tmp_path / "missing.toml")), "cannot read")


def test_serve_rejects_bad_config_before_starting(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[workers]\nrestart_backoff = 1\n")
    one_line_error(cli("serve", "--config", str(bad), "--state-dir", str(tmp_path)),
                   "unknown key workers.restart_backoff")


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


def test_model_init_tiny_cli(tmp_path):
    out = cli("model", "init-tiny", str(tmp_path / "m"), "--seed", "3")
    assert out.returncode == 0, out.stderr
    tok = ServedTokenizer(tmp_path / "m")
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"


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

    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
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
