"""SIGKILL in every phase of the Lance table's upgrade steps (planning's columns, chunk commits,
the fold, the finish, the abort) and of a rollback, at several moments each: after every kill the table still reads
as a whole gallery, a landed chunk is whole, and the same step run again completes it with
every item once and the right features."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from components.gallery.layouts.lance_table import LanceGallery
from components.platform.registry import ModelRef

N, OLD_DIM, NEW_DIM, CHUNK = 3000, 16, 24, 250
OLD = ModelRef("embedder", "1", OLD_DIM)
NEW = ModelRef("embedder", "2", NEW_DIM)
TOKEN = "plan-1"
ROOT = Path(__file__).resolve().parents[2]

STEP = r'''
import os, signal, sys
sys.path.insert(0, {root!r})
import lance
from lance.dataset import LanceDataset, MergeInsertBuilder
from components.gallery.layouts import lance_table
from tests.integration.test_lance_kill import data, chunk_positions, NEW, TOKEN, N, CHUNK

KILL_AFTER = {kill_after}  # SIGKILL right after this many Lance commits (0: never)
commits = 0


def counted(function):
    def call(*args, **kwargs):
        global commits
        result = function(*args, **kwargs)
        commits += 1
        if commits == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    return call


for name in ("merge", "add_columns", "drop_columns", "alter_columns", "update_schema_metadata", "restore"):
    setattr(LanceDataset, name, counted(getattr(LanceDataset, name)))
MergeInsertBuilder.execute = counted(MergeInsertBuilder.execute)
lance_table.lance = lance
lance.write_dataset = counted(lance.write_dataset)
d = data()
table = lance_table.LanceGallery({uri!r})
tags = type(table.dataset().tags)
tags.create = counted(tags.create)
print("started", flush=True)
step = {step!r}
if step == "plan":
    table.begin_upgrade("u1", NEW, d["mapped"], d["rank"], d["sigma"], token=TOKEN)
elif step == "chunks":
    for chunk in range(N // CHUNK):
        positions = chunk_positions(d, chunk)
        table.commit_chunk("u1", chunk, positions, d["new"][positions], TOKEN)
elif step == "fold":
    table.fold("u1")
elif step == "finish":
    table.finish("u1")
elif step == "abort":
    table.abort("u1")
elif step == "rollback":
    table.rollback()
print("done", commits, flush=True)
'''


def data():
    rng = np.random.default_rng(0)
    return {"old": rng.normal(size=(N, OLD_DIM)).astype(np.float32),
            "mapped": rng.normal(size=(N, NEW_DIM)).astype(np.float32),
            "new": rng.normal(size=(N, NEW_DIM)).astype(np.float32),
            "rank": rng.permutation(N), "sigma": rng.normal(size=N).astype(np.float32)}


def chunk_positions(d, chunk: int) -> np.ndarray:
    return np.argsort(d["rank"])[chunk * CHUNK:(chunk + 1) * CHUNK]


def _created(path: Path) -> LanceGallery:
    d = data()
    items = pa.table({"id": pa.array(np.arange(N, dtype=np.int64))})
    return LanceGallery.create(path, items, d["old"], OLD)


def _run(uri: str, step: str, *, kill_after: int = 0, delay: float | None = None) -> tuple[bool, int | None]:
    """Run ``step`` in a process of its own, SIGKILLed right after its ``kill_after``-th Lance
    commit, or ``delay`` seconds after it started working. (killed, the commits of a whole run)."""
    child = subprocess.Popen([sys.executable, "-c", STEP.format(root=str(ROOT), uri=uri, step=step,
                                                                 kill_after=kill_after)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert child.stdout.readline().strip() == "started"
    if delay is not None:
        time.sleep(delay)
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
    out, _ = child.communicate(timeout=120)
    killed = child.returncode == -signal.SIGKILL
    return killed, None if killed else int(out.split()[-1])


def _working_seconds(uri: str, step: str) -> float:
    """Seconds from a whole run's "started" to its "done": the step's work, without the
    process's start and exit."""
    child = subprocess.Popen([sys.executable, "-c", STEP.format(root=str(ROOT), uri=uri, step=step, kill_after=0)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert child.stdout.readline().strip() == "started"
    started = time.monotonic()
    assert child.stdout.readline().startswith("done")
    seconds = time.monotonic() - started
    child.communicate(timeout=120)
    return seconds


def _whole(table: LanceGallery, d) -> tuple[np.ndarray, np.ndarray]:
    """The mixed gallery reads whole: every item once, each row either h(old) or its new features."""
    vectors, backfilled, model = table.mixed()
    assert len(vectors) == N and np.isfinite(vectors).all()
    if model == NEW:
        assert np.array_equal(vectors[backfilled], d["new"][backfilled])
        assert np.array_equal(vectors[~backfilled], d["mapped"][~backfilled])
    else:
        assert np.array_equal(vectors, d["old"])
    return vectors, backfilled


def _prepared(path: Path, step: str) -> LanceGallery:
    """A table as ``step`` finds it: planned for the chunks and after; every chunk landed for the fold,
    the finish and the abort."""
    d = data()
    table = _created(path)
    if step != "plan":
        table.begin_upgrade("u1", NEW, d["mapped"], d["rank"], d["sigma"], token=TOKEN)
    if step in ("fold", "finish", "abort", "rollback"):
        for chunk in range(N // CHUNK):
            positions = chunk_positions(d, chunk)
            table.commit_chunk("u1", chunk, positions, d["new"][positions], TOKEN)
    if step == "rollback":
        table.finish("u1")
    return table


def _completed(table: LanceGallery, step: str) -> None:
    """``step`` run again to its end, then what it must have left."""
    d = data()
    if step == "plan":
        table.begin_upgrade("u1", NEW, d["mapped"], d["rank"], d["sigma"], token=TOKEN)
        assert np.array_equal(table.features("mapped"), d["mapped"]) and table.upgrade().token == TOKEN
        assert Path(table.backfill_uri).exists()
        return
    if step == "chunks":
        _, backfilled = _whole(table, d)
        for chunk in table.landed_chunks():  # a landed chunk is whole
            assert backfilled[chunk_positions(d, chunk)].all()
        assert backfilled.sum() == CHUNK * len(table.landed_chunks())
        for chunk in range(N // CHUNK):  # the backfill's re-run: every chunk again, done ones too
            positions = chunk_positions(d, chunk)
            table.commit_chunk("u1", chunk, positions, d["new"][positions], TOKEN)
        vectors, backfilled = _whole(table, d)
        assert backfilled.all() and np.array_equal(vectors, d["new"])
    elif step == "fold":
        table.fold("u1")
        assert not np.isnan(table.features("new")).any()
    elif step == "finish":
        table.finish("u1")
        assert table.model() == NEW and np.array_equal(table.features(), d["new"])
        assert not Path(table.backfill_uri).exists() and table.upgrade() is None
    elif step == "rollback":
        if len(table.serving_tags()) < 3:  # killed before its tag (a whole rollback run again would undo itself)
            assert table.rollback() == (NEW, OLD)
        assert table.model() == OLD and np.array_equal(table.features(), d["old"])
        assert [name for _, name, _ in table.serving_tags()] == ["serving-1", "serving-2", "serving-3"]
    else:
        table.abort("u1")
        assert table.upgrade() is None and np.array_equal(table.features(), d["old"])
        assert not Path(table.backfill_uri).exists()
    assert table.dataset().count_rows() == N


@pytest.mark.parametrize("step", ["plan", "chunks", "fold", "finish", "abort", "rollback"])
def test_killed_after_each_commit_of_a_step_then_run_again(tmp_path, step):
    """A step's every intermediate state: killed right after its 1st, 2nd, ... Lance commit (for
    the chunks, after the first, a middle and the last but one), the table read whole, the step
    run again to its end."""
    whole = _prepared(tmp_path / "whole", step)
    killed, commits = _run(whole.store_uri, step)
    assert not killed and commits >= 1
    _completed(whole, step)
    points = range(1, commits) if step != "chunks" else sorted({1, commits // 2, commits - 1})
    for n in points:
        table = _prepared(tmp_path / f"killed-{n}", step)
        killed, _ = _run(table.store_uri, step, kill_after=n)
        assert killed, f"{step}: not killed after commit {n} of {commits}"
        _whole(table, data())
        _completed(table, step)


@pytest.mark.parametrize("moment", (0.1, 0.4, 0.7))
def test_killed_at_any_moment_while_chunks_commit(tmp_path, moment):
    """Killed at a moment, not at a commit's end (a data file half written): the same. The moment
    is a fraction of how long a whole run of the chunks takes here; a run that ends before its
    kill, or whose kill came after its last commit, is tried again at half the delay, and the test
    fails unless a kill lands mid-run."""
    delay = moment * _working_seconds(_prepared(tmp_path / "whole", "chunks").store_uri, "chunks")
    for attempt in range(8):
        table = _prepared(tmp_path / f"killed-{attempt}", "chunks")
        killed, _ = _run(table.store_uri, "chunks", delay=delay)
        if killed and len(table.landed_chunks()) < N // CHUNK:
            break  # killed while chunks were still to commit
        delay /= 2  # the machine is slower or faster than when measured: earlier
    assert killed and len(table.landed_chunks()) < N // CHUNK, \
        f"no run of the chunks was killed before its last commit (the last try at {delay * 2:.3f} s)"
    _whole(table, data())
    _completed(table, "chunks")
