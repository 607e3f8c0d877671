"""One direction of imports: the daemon and the worker sit on the engines, the engines on
the KV handoff and the models; nothing below imports what is above it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "appliance"
BELOW = {
    "engines": ("appliance.worker", "appliance.daemon", "appliance.commands", "appliance.cli"),
    "kv": ("appliance.engines", "appliance.worker", "appliance.daemon"),
    "models": ("appliance.engines", "appliance.kv", "appliance.worker", "appliance.daemon"),
    # The planner gets callables from the daemon; it never speaks HTTP itself.
    "planner": ("appliance.daemon", "appliance.commands", "appliance.cli", "appliance.tui",
                "aiohttp", "urllib.request", "http.client"),
}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_lower_packages_do_not_import_upper_ones():
    wrong = []
    for package, forbidden in BELOW.items():
        for path in sorted((ROOT / package).glob("*.py")):
            for name in imports(path):
                if name.startswith(forbidden):
                    wrong.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not wrong, "\n".join(wrong)
