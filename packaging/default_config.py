"""Write the default /etc/applianced/config.toml: the manual's configuration block
(docs/configuration.md) with every line commented out. The daemon runs on its built-in
defaults, and the operator sees every key, its default and what it means in one place;
uncommenting a line changes one setting. Generated from the manual so the two cannot
drift apart.

    python packaging/default_config.py docs/configuration.md > config.toml
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

HEADER = """\
# applianced configuration. Every key is shown at its default, commented out: the
# daemon runs on the defaults as shipped (and also when this file is missing).
# Uncomment and change a line to override it; check with: applianced config check FILE
# Restart to apply: systemctl restart applianced
"""


def config_block(page: str) -> str:
    """The first TOML block of the configuration page: every key at its default."""
    match = re.search(r"```toml\n(.*?)```", page, re.S)
    if not match:
        raise SystemExit("no ```toml block in the configuration page")
    return match.group(1)


def commented(block: str) -> str:
    return HEADER + "\n" + "".join(f"#{line}\n" if line.strip() else "\n"
                                   for line in block.splitlines())


def main(argv: list[str]) -> int:
    page = Path(argv[1] if len(argv) > 1 else "docs/configuration.md").read_text()
    sys.stdout.write(commented(config_block(page)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
