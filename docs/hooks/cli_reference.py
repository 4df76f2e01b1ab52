"""MkDocs hook: render the `fleetserve` command line into docs/serving/cli.md at build time.

The page holds a marker, `<!-- fleetserve-cli-reference -->`; this hook replaces it with one
section per subcommand, built from the very parser `fleetserve --help` prints
(`fleetserve.cluster.cli.build_parser`). The flags of `serve` and `generate` are generated from
the config schema (`cluster/cli_engine.py`), so the page follows the schema with no edit here.

Building the parser imports the CLI modules and the config schema only: no Ray, no torch, no
model (the build log names any of them that the import pulled in, and how long it took).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time

from mkdocs.exceptions import PluginError

log = logging.getLogger("mkdocs.hooks.cli_reference")

PAGE = "serving/cli.md"
MARKER = "<!-- fleetserve-cli-reference -->"
USAGE_WIDTH = 100
DEFAULT_RE = re.compile(r"\s*\[default: (.*)\]\s*$", re.DOTALL)
# Characters that would turn into markdown outside code spans (inside a table cell).
_ESCAPE = {
    "\\": "\\\\",
    "*": "\\*",
    "_": "\\_",
    "[": "\\[",
    "]": "\\]",
    "|": "\\|",
    "<": "&lt;",
    ">": "&gt;",
    "&": "&amp;",
    "#": "\\#",
}


def _text(s: str) -> str:
    """Help text for a table cell: one line, markdown-safe, `code spans` kept as they are."""
    s = " ".join(s.split())
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", s)):
        if i % 2:  # a code span: literal already; only a pipe would still split the cell
            out.append(part)
        else:
            out.append("".join(_ESCAPE.get(c, c) for c in part))
    return "".join(out)


def _code(s: object) -> str:
    s = " ".join(str(s).split())
    fence = "``" if "`" in s else "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def _type(action: argparse.Action) -> str:
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "one of " + ", ".join(_code(c) for c in action.choices)
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "flag"
    if isinstance(action, argparse._VersionAction):
        return "flag"
    metavar = action.metavar if isinstance(action.metavar, str) else None
    t = getattr(action.type, "__name__", None)
    if t == "_json_value":
        name = "JSON"
    elif t in ("int", "float", "str"):
        name = t
    elif metavar:
        name = metavar
    else:
        name = "str"
    if action.nargs in ("+", "*"):
        name = f"{metavar or name} ..."
    elif action.nargs == "?":
        name = f"{name}, optional"
    return _code(name) if name else ""


def _help_and_default(action: argparse.Action) -> tuple[str, str]:
    text = (action.help or "").replace("%%", "%")
    if "%(default)s" in text:
        text = text.replace("%(default)s", str(action.default))
    m = DEFAULT_RE.search(text)
    if m:
        return text[: m.start()], m.group(1)
    default = action.default
    if default in (None, argparse.SUPPRESS) or isinstance(action, argparse._VersionAction):
        return text, ""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return text, ""
    return text, str(default)


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return _code(action.metavar if isinstance(action.metavar, str) else action.dest)
    return ", ".join(_code(o) for o in action.option_strings)


def _table(actions: list[argparse.Action]) -> list[str]:
    rows = ["| flag | type | default | what |", "|---|---|---|---|"]
    for a in actions:
        helptext, default = _help_and_default(a)
        shown = "unset" if default in ("", "unset") else _code(default)
        rows.append(f"| {_flag(a)} | {_type(a)} | {shown} | {_text(helptext)} |")
    return rows


def _usage(parser: argparse.ArgumentParser) -> str:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(USAGE_WIDTH)
    try:
        return parser.format_usage().strip()
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def _section(title: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    out = [f"## `{title}`", ""]
    if summary:
        out += [_text(summary), ""]
    out += ["```text", _usage(parser), "```", ""]
    for group in parser._action_groups:
        actions = [
            a for a in group._group_actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        ]
        if not actions:
            continue
        out += [f"### {group.title}", ""]
        out += _table(actions)
        out.append("")
    return out


def render() -> str:
    started = time.monotonic()
    before = set(sys.modules)
    try:
        from fleetserve.cluster.cli import build_parser
    except ImportError as e:  # the package is not installed where mkdocs runs
        raise PluginError(f"the CLI reference needs fleetserve importable (pip install -e .): {e}") from e
    parser = build_parser()
    heavy = sorted(m for m in ("ray", "torch", "transformers") if m in sys.modules and m not in before)
    log.info(
        "cli_reference: parser built in %.2f s%s",
        time.monotonic() - started,
        f" (imported {', '.join(heavy)})" if heavy else "",
    )

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {c.dest: c.help or "" for c in sub._choices_actions}
    lines = [f"Subcommands: {', '.join(f'[`{n}`](#fleetserve-{n})' for n in sub.choices)}.", ""]
    lines += _section("fleetserve", parser, parser.description or "")
    for name, sp in sub.choices.items():
        lines += _section(f"fleetserve {name}", sp, sp.description or summaries.get(name, ""))
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"{PAGE} lost its marker {MARKER}")
    return markdown.replace(MARKER, render())
