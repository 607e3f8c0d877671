"""The manual builds as a site in strict mode, so a broken link or anchor or a page
missing from the nav fails (the command and link checks: tests/unit/test_docs.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.daemons import ROOT

DOCS = ROOT / "docs"


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], capture_output=True, text=True, timeout=300, env=env)


def test_site_builds_in_strict_mode(tmp_path):
    out = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    for page in ("index.html", "configuration/index.html", "operations/chargeback/index.html",
                 "engines/torch/index.html", "tui-overview.svg"):
        assert (tmp_path / "site" / page).is_file(), page


def test_strict_build_fails_on_a_broken_link_and_a_page_left_out_of_the_nav(tmp_path):
    """The validation settings are what make the build above mean something."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    api = tmp_path / "docs" / "api.md"
    api.write_text(api.read_text() + "\nSee [the old page](no-such-page.md).\n")
    out = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "no-such-page.md" in out.stdout + out.stderr

    api.write_text(api.read_text().replace("[the old page](no-such-page.md)",
                                           "[limits](install.md#no-such-heading)"))
    out = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "no-such-heading" in out.stdout + out.stderr

    api.write_text(api.read_text().replace("[limits](install.md#no-such-heading)", "limits"))
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    out = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "orphan.md" in out.stdout + out.stderr
