"""Command-line parsing shared by the subcommands: one-line usage errors (exit 2), one-line-per-option
--help, output paths checked before any work, resumable jobs. The values' parsers are in
moestream.flag_values."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable, NoReturn

USAGE_EXIT = 2
HELP_COLUMN = 26  # where an option's help starts in --help


class ShortHelp(argparse.HelpFormatter):
    """--help as one line per option: the first clause of its help, cut to the line; the rest
    (defaults' reasons, measurements) is in the README's flag tables. The usage line is
    `prog [options] POSITIONALS`, not every flag again."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=HELP_COLUMN)

    def _format_usage(self, usage, actions, groups, prefix) -> str:
        if usage is None:
            names = [a.metavar or a.dest for a in actions if not a.option_strings and a.help != argparse.SUPPRESS]
            usage = " ".join([self._prog, "[options]", *[n if isinstance(n, str) else " ".join(n) for n in names]])
        return f"{prefix or 'usage: '}{usage}\n\n"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:  # laid out by hand (examples): kept as written
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _format_action(self, action: argparse.Action) -> str:
        head = " " * self._current_indent + invocation(action)
        if not action.help:
            return head + "\n"
        column = max(len(head) + 2, HELP_COLUMN)
        room = max(self._width - column, 24)
        text = first_clause(self._expand_help(action))
        if len(text) > room:  # the longest run of whole clauses, else of whole words, that fits
            cut = max(text.rfind(", ", 0, room), text.rfind(" (", 0, room))
            text = text[:cut] if cut > room // 2 else text[:room - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"
            text = balanced(text)
        return f"{head:<{column}}{text}\n"


def invocation(action: argparse.Action) -> str:
    """`--flag VALUE`: the first long spelling (other spellings still work), the value's name or choices."""
    if not action.option_strings:
        return str(action.metavar or action.dest)
    flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
    if action.nargs == 0:
        return flag
    if action.metavar is not None:
        value = action.metavar
    elif action.choices is not None and len("|".join(map(str, action.choices))) <= 24:
        value = "|".join(map(str, action.choices))
    else:
        value = action.dest.upper() if len(action.dest) <= 8 else "VALUE"
    return f"{flag} {value}"


def first_clause(text: str) -> str:
    """A help text's first clause: up to the first '; ' or '. ', less a parenthesis left open."""
    return balanced(re.split(r"; |(?<!e\.g)(?<!i\.e)\. ", " ".join(text.split()), maxsplit=1)[0].rstrip("."))


def balanced(text: str) -> str:
    """The text less a parenthesis it opens and does not close (an interval's `]` closes one)."""
    while text.count("(") > text.count(")") + text.count("]"):
        text = text[:text.rindex("(")].rstrip(" ,:")
    return text


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage dump), exit code 2, and --help
    one line per option (ShortHelp)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", ShortHelp)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message}\n")


def check_output_paths(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: dict[str, str]) -> None:
    """Refuse output files whose folder does not exist, before any work (not after generating).

    ``flags``: {attribute name: flag as the user typed it}."""
    for attr, flag in flags.items():
        value = getattr(args, attr, None)
        if not value:
            continue
        folder = Path(value).expanduser().absolute().parent
        if not folder.is_dir():
            parser.error(f"argument {flag}: the folder {folder} does not exist")
        if Path(value).is_dir():
            parser.error(f"argument {flag}: {value} is a folder, not a file")


def fail(prog: str, message: str, code: int = 1) -> int:
    """Print a one-line error for a problem found after parsing; returns the exit code."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def run_resumable(prog: str, work: Callable[[], object], done: str) -> int:
    """Run a long, resumable job (convert, pull): its result printed as `done.format(result)`, exit 0;
    a MoestreamError or OS error one line, exit 1; Ctrl+C one line naming --resume, exit 130."""
    from moestream.errors import MoestreamError

    try:
        result = work()
    except MoestreamError as exc:
        return fail(prog, str(exc))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (run again with --resume to continue)", file=sys.stderr)
        return 130
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return fail(prog, f"{where}{exc.strerror or exc}")
    print(done.format(result))
    return 0
