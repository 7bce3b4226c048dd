"""Every command's help at 80 columns: options and defaults whole, no markup, every subcommand
with a one-line summary in its group's list; `fastfill --version`."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from fastfill.cli import app


def _commands(group, path: tuple[str, ...] = ()):
    for name in sorted(group.list_commands(None)):  # a top-level command's module loads here (cli/__init__.py)
        command = group.get_command(None, name)
        yield (*path, name), command
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


ROOT = typer.main.get_command(app)
COMMANDS = [((), ROOT), *_commands(ROOT)]


def _help(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERM": "dumb"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(p) or "fastfill" for p, _ in COMMANDS])
def test_help_reads_whole_at_80_columns(path, command):
    text = _help(path)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "…" not in text and not re.search(r"\w\.\.\.$", text, re.M), f"something is cut:\n{text}"
    assert "``" not in text and "`" not in text, f"markup in help:\n{text}"
    for param in command.params:
        for flag in param.opts + param.secondary_opts:
            assert flag in text, f"{flag} missing from the help of {' '.join(path)}:\n{text}"
    if hasattr(command, "commands"):  # every subcommand listed, with a summary that fits
        for name in command.list_commands(None):
            line = next((row for row in text.splitlines() if row.strip().startswith(name + " ")), None)
            assert line is not None and len(line.split(None, 1)) == 2, f"{name} has no summary in:\n{text}"


def test_version():
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"fastfill {version('fastfill')}"
