"""The commented default config that `make install` writes is docs/configuration.md's
block and parses to the defaults. (`make install` itself: tests/integration/test_install.py.)"""
from __future__ import annotations

import sys

from helpers.daemons import ROOT

from appliance import config
sys.path.insert(0, str(ROOT / "packaging"))
import default_config  # noqa: E402


def test_default_config_is_the_manual_block_commented_out():
    page = (ROOT / "docs" / "configuration.md").read_text()
    text = default_config.commented(default_config.config_block(page))
    assert config.parse(text, "default") == config.Config()        # as shipped: defaults
    lines = [line for line in text.splitlines() if line.strip()]
    body = lines[lines.index(next(line for line in lines if line.startswith("#state_dir"))):]
    assert all(line.startswith("#") for line in body)
    # Uncommenting every line gives the same defaults, and every key is there to uncomment.
    uncommented = "\n".join(line[1:] for line in body)
    assert config.parse(uncommented, "uncommented") == config.Config()
    for section in ("server", "devices", "engine", "workers", "site", "auth"):
        assert f"\n[{section}]" in "\n" + uncommented
    assert "port = 8000" in uncommented
