"""The manual (docs/) and the README: the site builds in strict mode, so a broken link or
anchor or a page missing from the nav fails; every `applianced ...` command shown in a
shell block parses against the real argument parser; the README stays a front page whose
links resolve."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from markdown.extensions.toc import slugify

from helpers.daemons import ROOT

from appliance.cli import build_parser

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
SHELL_FENCES = {"sh", "bash", "shell", "console"}
# A line that runs applianced: VAR=value assignments and sudo may come first.
COMMAND_LINE = re.compile(r"\s*([A-Z_][A-Z0-9_]*=\S*\s+)*(sudo\s+)?\S*applianced(\s|$)")
# Pages other branches add; the README links to them already. Once one exists, drop it
# from here and add it to mkdocs.yml's nav (the strict build fails until then anyway).
PENDING: set[str] = set()


def shell_blocks(text: str) -> list[str]:
    """The bodies of fenced code blocks tagged as shell, with continuation lines joined."""
    blocks = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.S | re.M):
        if match.group(2) in SHELL_FENCES:
            indent = len(match.group(1))
            body = "\n".join(line[indent:] for line in match.group(3).splitlines())
            blocks.append(body.replace("\\\n", " "))
    return blocks


def applianced_commands(text: str) -> list[list[str]]:
    """Each `applianced ...` command in the shell blocks, as its argument list: leading
    VAR=value assignments and sudo dropped, cut at a comment, `&`, a pipe or a redirect."""
    commands = []
    for block in shell_blocks(text):
        for line in block.splitlines():
            if not COMMAND_LINE.match(line):
                continue        # other commands (curl with a JSON body over several lines ...)
            words = shlex.split(line, comments=True)
            while words and (words[0] == "sudo" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0])):
                words.pop(0)
            if not words or Path(words[0]).name != "applianced":
                continue
            args = []
            for word in words[1:]:
                if word in {"&", "&&", "||", "|", ";"} or word.startswith((">", "<", "2>")):
                    break
                args.append(word)
            commands.append(args)
    return commands


def parse_error(args: list[str]) -> str | None:
    """argparse's complaint about this command line, or None when it parses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


def test_every_cli_command_shown_parses():
    seen, wrong = {}, []
    for page in PAGES:
        for args in applianced_commands(page.read_text()):
            seen.setdefault(page.relative_to(ROOT).as_posix(), []).append(args)
            if (error := parse_error(args)) is not None:
                wrong.append(f"{page.relative_to(ROOT)}: applianced {shlex.join(args)}: {error}")
    assert not wrong, "\n".join(wrong)
    # It finds them: many commands, across the pages that show them.
    assert sum(map(len, seen.values())) >= 30, seen
    for page in ("README.md", "docs/operations/workflows.md", "docs/install.md",
                 "docs/operations/capacity-planning.md", "docs/admin-api.md"):
        assert page in seen, page
    subcommands = {args[0] for commands in seen.values() for args in commands if args}
    assert {"serve", "status", "tui", "workflow", "plan", "usage", "carbon"} <= subcommands


def test_the_cli_check_catches_a_bad_command():
    page = """
```sh
applianced serve --devices sim:8xH100 --no-such-flag   # a flag that does not exist
SOME_VAR=1 sudo applianced workflow start repartition --split 6+2 &
applianced plan --horizon
.venv/bin/applianced usage --by tenant --csv > usage.csv
```

```text
applianced serve --not-checked-in-a-text-block
```
"""
    commands = applianced_commands(page)
    assert commands == [["serve", "--devices", "sim:8xH100", "--no-such-flag"],
                        ["workflow", "start", "repartition", "--split", "6+2"],
                        ["plan", "--horizon"],
                        ["usage", "--by", "tenant", "--csv"]]
    assert "--no-such-flag" in parse_error(commands[0])
    assert parse_error(commands[1]) is None
    assert "--horizon" in parse_error(commands[2])
    assert parse_error(commands[3]) is None


def links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def headings_slugs(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(h, "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_readme_is_a_front_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    # The quick start is the two commands, and both are make targets.
    quick = readme.split("## Quick start", 1)[1]
    block = shell_blocks(quick)[0]
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["make serve", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve:", makefile, re.M) and re.search(r"^test:", makefile, re.M)

    targets = [link for link in links(readme) if not re.match(r"[a-z]+:", link)]
    assert len(targets) >= 15
    wrong = []
    for link in targets:
        path, _, anchor = link.partition("#")
        if path in PENDING:
            if (ROOT / path).exists():
                wrong.append(f"{path} exists now: drop it from PENDING, add it to mkdocs.yml's nav")
            continue
        if not (ROOT / path).exists():
            wrong.append(f"{link}: no such file")
        elif anchor and anchor not in headings_slugs(ROOT / path):
            wrong.append(f"{link}: no such heading")
    assert not wrong, wrong


def subcommands(parser, path=()) -> dict[tuple[str, ...], set[str]]:
    """Every runnable command of the parser (internal ones left out), with its options."""
    found = {}
    actions = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    if not actions or not all(a.required for a in actions):     # `plan` runs on its own too
        found[path] = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    for action in actions:
        helps = {c.dest: c.help or "" for c in action._choices_actions}
        for name, sub in action.choices.items():
            if not helps.get(name, "").startswith("(internal)"):
                found.update(subcommands(sub, path + (name,)))
    return found


def synopsis(page: str) -> dict[tuple[str, ...], set[str]]:
    """The CLI page's synopsis block: each command it lists, with the options it shows."""
    block = re.search(r"```text\n(applianced .*?)```", page, re.S).group(1)
    entries = re.sub(r"\n\s+(?=\[)", " ", block).splitlines()      # continuation lines
    commands = subcommands(build_parser())
    shown: dict[tuple[str, ...], set[str]] = {}
    for entry in entries:
        words = entry.split("#")[0].split()[1:]
        path: tuple[str, ...] = ()
        for segment in " ".join(words).split(" | "):
            seg_words = segment.split()
            if path:                      # `workflow list | show ID | cancel ID`
                path = path[:-1]
            for word in seg_words:
                if any(c[:len(path) + 1] == path + (word,) for c in commands):
                    path += (word,)
                elif "|" in word and all(any(c[:len(path) + 1] == path + (w,) for c in commands)
                                         for w in word.split("|")):
                    for w in word.split("|"):  # `workflow start repartition|swap-model|...`
                        shown.setdefault(path + (w,), set()).update(
                            re.findall(r"--[a-z][a-z0-9-]*", segment))
                    path = ()
                    break
                else:
                    break
            if path:
                shown.setdefault(path, set()).update(re.findall(r"--[a-z][a-z0-9-]*", segment))
    return shown


def test_cli_synopsis_is_the_parser():
    """docs/cli.md's synopsis lists every command and every option the parser has, and
    nothing it does not have."""
    parser_commands = subcommands(build_parser())
    shown = synopsis((DOCS / "cli.md").read_text())
    assert len(parser_commands) >= 15
    missing = sorted(" ".join(c) for c in parser_commands if c not in shown)
    assert not missing, f"commands missing from docs/cli.md: {missing}"
    unknown = sorted(" ".join(c) for c in shown if c not in parser_commands)
    assert not unknown, f"docs/cli.md shows commands the parser lacks: {unknown}"
    wrong = {" ".join(c): (sorted(shown[c] - opts), sorted(opts - shown[c]))
             for c, opts in parser_commands.items() if shown[c] != opts}
    assert not wrong, f"docs/cli.md options (shown but unknown, known but not shown): {wrong}"


def test_the_synopsis_check_catches_a_stale_option_and_a_missing_command():
    page = (DOCS / "cli.md").read_text()
    parser_commands = subcommands(build_parser())
    stale = synopsis(page.replace("[--log-requests]", "[--log-requests] [--no-such-flag]"))
    assert "--no-such-flag" in stale[("serve",)] - parser_commands[("serve",)]
    assert ("version",) not in synopsis(page.replace("applianced version\n", ""))
