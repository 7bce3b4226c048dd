"""`--json`: a command's answer as one JSON document on stdout, and nothing else there.

``answers_json`` wraps a command that takes ``as_json: JsonOption``. With ``--json`` the
command's text output and everything else that would reach stdout (a library's print, a child
process's lines) goes to stderr while it runs; the command hands its document to ``answer``,
and the document is written on stdout when the command ends, whatever its exit code. A known
failure (``command_support.fail``) still prints its ``error:`` line on stderr, and its exit code
is unchanged; the document is then ``{"schema": "fastfill.error/1", "error": ..., "exit_code": N}``.

Every document is an object whose ``schema`` key names it and its version
(``fastfill.<command>/<n>``); the builders below, one per command family, give each its
fields. docs/json.md documents each schema. Nothing here imports torch."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fastfill.components.gallery.upgrade.outcome import Decision, UpgradeResult

if TYPE_CHECKING:  # the dry run's module loads torch: only its type here
    from fastfill.components.gallery.advice.estimate import DryRun
    from fastfill.components.gallery.store.lock import LockRecord

JsonOption = Annotated[bool, typer.Option("--json", help="answer with one JSON document on stdout (docs/json.md)")]

ERROR_SCHEMA = "fastfill.error/1"


class _Answer:
    document: dict | None = None


_current: _Answer | None = None  # the answer of the command running with --json; None in text mode


def json_mode() -> bool:
    """Whether the running command answers in JSON (its text lines are then left out)."""
    return _current is not None


def answer(schema: str, fields: dict) -> None:
    """The running command's document: ``schema`` first, then ``fields`` made plain JSON
    (numpy numbers as numbers, NaN and infinities as null, tuples as lists)."""
    if _current is None:
        raise RuntimeError("answer() outside a command run with --json")
    _current.document = {"schema": schema, **plain(fields)}


def failed(message: str, code: int) -> None:
    """A known failure of the running command (``fail``): with --json its document says so."""
    if _current is not None:
        _current.document = {"schema": ERROR_SCHEMA, "error": message, "exit_code": code}


def plain(value):
    """``value`` as JSON can hold it: dicts, lists, str, int, float (finite), bool, None."""
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(item) for item in value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return plain(value.tolist())
    if hasattr(value, "value") and isinstance(value.value, str):  # enums
        return value.value
    return str(value)


@contextlib.contextmanager
def _stdout_kept_for_the_answer():
    """stdout to stderr while the command runs (Python's sys.stdout, and file descriptor 1 where
    stdout is it, so child processes and handlers that hold the stream follow); yields the
    stream to write the document to afterwards."""
    out = sys.stdout
    out.flush()
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    saved = None
    if fd is not None:
        sys.stderr.flush()
        saved = os.dup(fd)
        os.dup2(sys.stderr.fileno(), fd)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield out
    finally:
        if saved is not None:
            out.flush()  # what was buffered while diverted goes to stderr
            os.dup2(saved, fd)
            os.close(saved)


def answers_json(command):
    """The decorator of a command with a ``--json`` option (``as_json: JsonOption``); put it
    under ``@app.command(...)``."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        global _current
        if not kwargs.get("as_json"):
            return command(*args, **kwargs)
        given = _Answer()
        _current = given
        out = None
        try:
            with _stdout_kept_for_the_answer() as out:
                return command(*args, **kwargs)
        finally:
            _current = None
            if out is not None and given.document is not None:
                out.write(json.dumps(given.document, indent=2, allow_nan=False) + "\n")
                out.flush()

    return run


def number(text) -> int | None:
    """A count the registry keeps as text ("512", "none", "?") as a number, or None."""
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


# ---- the documents, by command family: each returns (schema, fields)


# upgrade: the run, its dry run; status, unlock, abort

def upgrade_document(store: str, result: UpgradeResult, seconds: float) -> tuple[str, dict]:
    """`fastfill upgrade`: the run's result (components/gallery/upgrade/outcome.py
    ``UpgradeResult``), every field present (null where this run has none)."""
    fields = {"store": store, **result.as_dict(), "seconds": round(seconds, 3)}
    if result.state == "up-to-date" and not result.message:  # what the text line says
        fields["message"] = f"the gallery is already built with {result.model}; nothing to upgrade"
    return "fastfill.upgrade/2", fields


def dry_run_document(dry: DryRun) -> tuple[str, dict]:
    """`fastfill upgrade --dry-run`: the plan (components/gallery/advice/estimate.py
    ``dry_run_upgrade``), nothing written."""
    return "fastfill.upgrade.dry_run/1", {"written": False, **dry.as_dict()}


def status_document(command: str, state: dict) -> tuple[str, dict]:
    """`fastfill gallery info` and `fastfill upgrade status` (``command``: gallery.info or
    upgrade.status): the gallery's state (components/gallery/upgrade/status.py)."""
    return f"fastfill.{command}/1", state


def unlock_document(store: str, held: LockRecord | None) -> tuple[str, dict]:
    """`fastfill upgrade unlock`: the lock it removed (its holder), without the lock's token."""
    lock = held.holder() if held is not None else None
    return "fastfill.upgrade.unlock/1", {"store": store, "removed": held is not None, "lock": lock}


def undo_document(command: str, store: str, result: dict) -> tuple[str, dict]:
    """`fastfill upgrade abort` and `fastfill gallery rollback`: the undoing flow's result."""
    return f"fastfill.{command}/1", {"store": store, **result}


# gallery: gc, convert (rollback above)

def gc_document(store: str, deleted: dict) -> tuple[str, dict]:
    return "fastfill.gallery.gc/1", {"store": store, "deleted_features": deleted["features"],
                                     "deleted_upgrade_objects": deleted["upgrade_objects"],
                                     "kept_team_columns": deleted.get("kept_columns", [])}


def convert_document(result: dict) -> tuple[str, dict]:
    return "fastfill.gallery.convert/1", result


# doctor and status

def doctor_document(checks: list[tuple[str, str, str]]) -> tuple[str, dict]:
    """`fastfill doctor`: each check's (name, state: ok, fail or not_set_up, text), in order."""
    return "fastfill.doctor/1", {"ok": all(state != "fail" for _, state, _ in checks),
                                 "checks": {name: {"state": state, "text": text} for name, state, text in checks}}


def decision_fields(decided: Decision | None) -> dict | None:
    """A promotion decision (an upgrade's decision.json) as the status document shows it."""
    if decided is None:
        return None
    return {"upgrade": decided.upgrade_id, "decided": decided.decided, "verdict": decided.verdict,
            "passed": decided.passed, "new": decided.new.uri if decided.new else None,
            "champion": decided.champion.uri if decided.champion else None, "reasons": list(decided.reasons),
            "numbers": decided.numbers}


# model: register, list, show

def version_fields(name: str, row: dict) -> dict:
    """One version as `model list` and `model register` show it: a row of
    ``catalogue.VersionSummary.to_dict`` with its counts as numbers."""
    return {"name": name, "version": str(row["version"]), "uri": f"models:/{name}/{row['version']}",
            "aliases": list(row.get("aliases") or []), "source": row.get("source"),
            "embedding_dim": number(row.get("embedding_dim")), "head": number(row.get("head")),
            "input": row.get("input")}


def model_list_document(name: str, rows: list[dict]) -> tuple[str, dict]:
    return "fastfill.model.list/1", {"name": name, "versions": [version_fields(name, row) for row in rows]}


# webhooks

def webhook_fields(hook, events: list[str]) -> dict:
    return {"id": hook.webhook_id, "name": hook.name, "status": plain(hook.status), "events": events,
            "url": hook.url}
