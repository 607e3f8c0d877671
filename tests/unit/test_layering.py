"""One direction of imports: the daemon and the worker sit on the engines, the engines on
the KV handoff and the models; nothing below imports what is above it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "appliance"
BELOW = {
    "engines": ("appliance.worker", "appliance.daemon", "appliance.commands", "appliance.cli"),
    "kv": ("appliance.engines", "appliance.worker", "appliance.daemon"),
    "models": ("appliance.engines", "appliance.kv", "appliance.worker", "appliance.daemon"),
    # The planner gets callables from the daemon; it never speaks HTTP itself.
    "planner": ("appliance.daemon", "appliance.commands", "appliance.cli", "appliance.tui",
                "aiohttp", "urllib.request", "http.client"),
    # The console's view models are computed from JSON alone: no widgets, no HTTP.
    "tui/views": ("textual", "appliance.tui.screens", "appliance.tui.app", "appliance.tui.feed",
                  "aiohttp", "urllib.request", "http.client", "httpx"),
}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            if node.module == "appliance":         # from appliance import config
                out.update(f"appliance.{a.name}" for a in node.names
                           if (ROOT / a.name).is_dir() or (ROOT / f"{a.name}.py").is_file())
    return out


def test_lower_packages_do_not_import_upper_ones():
    wrong = []
    for package, forbidden in BELOW.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in imports(path):
                if name.startswith(forbidden):
                    wrong.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not wrong, "\n".join(wrong)


# Where each part of appliance/ sits: what it may import of the others (itself always).
# A module that imports a part above its own fails, and so does a new package or
# top-level module until it is given its place here.
EVERYTHING = {"accounting", "audit", "config", "daemon", "engines", "keystore", "kv", "models",
              "partitions", "percentiles", "planner", "routing", "telemetry", "tui", "worker",
              "workflows"}
LAYERS = {
    "__init__": set(), "config": set(), "percentiles": set(), "routing": set(),
    "models": set(),
    "partitions": set(),
    # The keys file and the audit log: files in the state directory, shared by the daemon
    # and the `keys` command (no HTTP).
    "keystore": set(), "audit": {"keystore"},
    "kv": {"models"},
    "engines": {"kv", "models", "partitions", "percentiles"},
    "worker": {"engines", "kv", "models", "partitions", "config"},
    "telemetry": {"engines", "partitions", "percentiles", "worker", "config"},
    "accounting": {"engines", "models", "partitions", "percentiles", "telemetry", "worker",
                   "config"},
    "workflows": {"models", "partitions", "config"},
    "planner": {"accounting", "config", "engines", "models", "partitions", "percentiles",
                "routing", "telemetry", "worker"},
    # The console is a client of the admin API: nothing of the daemon or below.
    "tui": {"config"},
    # The daemon wires everything below it; it never reaches up into the CLI or the console.
    "daemon": EVERYTHING - {"tui"},
    "commands": EVERYTHING | {"commands", "cli"},
    "cli": EVERYTHING | {"commands"},
    "__main__": {"cli"},
}
# Below the daemon nothing speaks HTTP or draws a console.
NO_HTTP = ("engines", "kv", "models", "partitions", "telemetry", "accounting", "planner",
           "workflows", "worker", "keystore", "audit")
HTTP_AND_UI = ("aiohttp", "urllib.request", "http.client", "http.server", "httpx", "requests",
               "textual", "rich.live")


def part(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def layer_violations(layers: dict[str, set[str]]) -> list[str]:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        mine = part(path)
        if mine not in layers:
            wrong.append(f"{path.relative_to(ROOT.parent)}: {mine!r} has no place in LAYERS")
            continue
        for name in sorted(imports(path)):
            if name.startswith("appliance."):
                other = name.split(".")[1]
                if other != mine and other not in layers[mine]:
                    wrong.append(f"{path.relative_to(ROOT.parent)} imports {name}")
            elif mine in NO_HTTP and name.startswith(HTTP_AND_UI):
                wrong.append(f"{path.relative_to(ROOT.parent)} imports {name} (no HTTP or UI "
                             "below the daemon)")
    return wrong


def test_every_part_imports_only_the_parts_below_it():
    wrong = layer_violations(LAYERS)
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_catches_an_upward_import_and_a_new_package():
    """The check itself: take a part's right to an import away, or a part's place, and it
    fails (the telemetry hub imports the engines' messages; the kv package exists)."""
    assert any("appliance/telemetry/" in w and "appliance.engines" in w
               for w in layer_violations({**LAYERS, "telemetry": LAYERS["telemetry"] - {"engines"}}))
    assert any("'kv' has no place" in w
               for w in layer_violations({k: v for k, v in LAYERS.items() if k != "kv"}))


DAEMON = ROOT / "daemon"
# The modules that serve HTTP: they reach the service and its subsystems through the
# app's typed keys (`responses.SERVICE`, `PLANNER`, …), never through the module that
# builds the daemon.
HANDLERS = ("openai_routes", "admin", "admin_audit", "admin_live", "admin_plan", "admin_tenants",
            "admin_usage",
            "admin_workflows", "responses", "auth", "server", "http_parser_errors", "openapi")
# What builds the daemon: a handler never imports these.
WIRING = {"main", "setup", "planner_link", "accounting_link", "supervisor", "control"}


def handler_modules() -> set[str]:
    """The daemon modules that serve HTTP, found by what they contain (a request handler or
    a route), so a new handler module is held to the rule without being listed."""
    return {p.stem for p in DAEMON.glob("*.py")
            if p.stem not in WIRING and any(s in p.read_text() for s in
                                            ("web.Request", "router.add_", "add_routes("))}


def daemon_graph() -> dict[str, set[str]]:
    """Module -> the daemon modules it imports, counting imports made only for type
    checking: a circle of types is a circle in the design all the same."""
    graph = {}
    for path in sorted(DAEMON.glob("*.py")):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "appliance.daemon":
                    deps.update(a.name for a in node.names)
                elif node.module.startswith("appliance.daemon."):
                    deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names
                            if a.name.startswith("appliance.daemon."))
        graph[path.stem] = deps - {path.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_daemon_imports_have_no_circle():
    graph = daemon_graph()
    assert {"main", "service", "setup", "openai_routes"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_nothing_in_the_daemon_imports_main_and_handlers_not_the_builders():
    graph = daemon_graph()
    importers = sorted(m for m, deps in graph.items() if "main" in deps)
    assert importers == [], f"{importers} import daemon.main (only the CLI may)"
    outside = sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
                     if p.parent != DAEMON and p != ROOT / "cli.py"
                     and any(n == "appliance.daemon.main" for n in imports(p)))
    assert outside == [], f"{outside} import daemon.main (only the CLI may)"
    found = handler_modules()
    assert set(HANDLERS) - {"http_parser_errors"} <= found, found
    for handler in sorted(found | set(HANDLERS)):
        wrong = graph[handler] & WIRING
        # admin_usage may name the accounting link's type: it is what its key holds
        wrong -= {"accounting_link"} if handler in ("admin_usage", "responses") else set()
        assert not wrong, f"{handler} imports {sorted(wrong)}"


def test_no_module_sets_an_attribute_on_the_service():
    """The Service is built whole by `daemon.main` from its subsystems; what changes while
    it runs lives in `daemon.state`. An assignment to `svc.<field>` elsewhere would
    finish building it from outside again."""
    wrong = []
    for path in sorted(DAEMON.glob("*.py")):
        if path.stem == "service":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and (
                        (isinstance(t.value, ast.Name) and t.value.id == "svc")
                        or (isinstance(t.value, ast.Attribute) and t.value.attr == "svc")):
                    wrong.append(f"{path.name}:{node.lineno} sets svc.{t.attr}")
    assert not wrong, "\n".join(wrong)


def test_no_handler_probes_for_a_subsystem():
    """Subsystems are declared fields or app keys; nobody asks whether one exists."""
    wrong = [f"{p.name}: {line.strip()}" for p in sorted(DAEMON.glob("*.py"))
             for line in p.read_text().splitlines()
             if "getattr(svc" in line or "getattr(self.svc" in line]
    assert not wrong, "\n".join(wrong)


def undefined_globals(source: str) -> set[str]:
    """Module-level names a module's code uses but never defines or imports (what a
    moved function or a merge most easily leaves behind, found only when it runs)."""
    import builtins
    import symtable
    top = symtable.symtable(source, "module", "exec")
    defined = {s.get_name() for s in top.get_symbols()
               if s.is_assigned() or s.is_imported() or s.is_namespace()}
    found = set()

    def walk(table) -> None:
        for s in table.get_symbols():
            name = s.get_name()
            if (s.is_referenced() and (s.is_global() or table is top) and name not in defined
                    and not hasattr(builtins, name) and name not in ("__file__", "__name__")):
                found.add(name)
        for child in table.get_children():
            walk(child)
    walk(top)
    return found


def test_undefined_globals_are_found():
    assert undefined_globals("import os\ndef f():\n    return os.sep, KEY\n") == {"KEY"}


def test_daemon_and_console_modules_use_no_undefined_name():
    wrong = [f"{path.relative_to(ROOT.parent)}: {sorted(names)}"
             for package in ("daemon", "tui")
             for path in sorted((ROOT / package).rglob("*.py"))
             if (names := undefined_globals(path.read_text()))]
    assert not wrong, "\n".join(wrong)
