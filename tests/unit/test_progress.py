"""fastfill.components.platform.progress: log lines with rate and time left at most every N seconds and
at the end; a tqdm bar on a stream; the mode from the argument, FASTFILL_PROGRESS or the
terminal; thread safety; and the bar as a pseudo-terminal really shows it (also one nobody
sized, 0 x 0, where tqdm alone draws nothing)."""

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fastfill.components.platform import progress as pg

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _logged(total=100, every=10.0, **kwargs):
    clock, lines = Clock(), []
    bar = pg.Progress("embedding the map sample", total, unit="image", mode="log", log=lines.append, every=every,
                      clock=clock, **kwargs)
    return bar, clock, lines


def test_the_log_mode_says_done_total_percent_rate_and_time_left_at_most_every_interval():
    bar, clock, lines = _logged()
    clock.now += 4
    bar.advance(20)
    assert lines == []  # 4 s: too soon
    clock.now += 6
    bar.advance(20)  # 10 s, 40 done: 4 image/s, 60 left: 15 s
    assert lines == ["embedding the map sample: 40/100 images (40%), 4.0 image/s, 10 s elapsed, about 15 s left"]
    clock.now += 5
    bar.advance(10)
    assert len(lines) == 1
    clock.now += 5
    bar.update_to(80)  # 20 s, 80 done: 4 image/s, 5 s left
    assert lines[-1] == "embedding the map sample: 80/100 images (80%), 4.0 image/s, 20 s elapsed, about 5 s left"
    clock.now += 5
    bar.advance(20)
    bar.close()
    bar.close()  # once
    assert lines[-1] == "embedding the map sample: done, 100/100 images (100%) in 25 s, 4.0 image/s"
    assert len(lines) == 3


def test_a_log_line_with_long_durations_an_unknown_total_a_resume_and_a_failure():
    bar, clock, lines = _logged(total=1_000_000, every=0, initial=400_000)
    clock.now += 3 * 3600
    bar.advance(300_000)  # 300,000 in 3 h: 27.8/s, 300,000 left: 3 h
    assert lines[-1] == ("embedding the map sample: 700,000/1,000,000 images (70%), 27.8 image/s, 3 h 00 min "
                         "elapsed, about 3 h 00 min left")
    bar, clock, lines = _logged(total=None, every=0)
    clock.now += 125
    bar.advance(50)
    assert lines[-1] == "embedding the map sample: 50 images, 2.5 s/image, 2 min 05 s elapsed"
    bar, clock, lines = _logged(every=1000)
    with pytest.raises(RuntimeError), bar:
        clock.now += 2
        bar.advance(5)
        raise RuntimeError("boom")
    assert lines == ["embedding the map sample: stopped at 5/100 images (5%) in 2 s, 2.5 image/s"]


def test_the_log_mode_prints_on_the_stream_by_default_and_the_off_mode_says_nothing():
    stream = io.StringIO()
    with pg.progress("planning", total=4, unit="part", mode="log", every=0, stream=stream) as bar:
        for _ in range(4):
            bar.advance()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 5 and lines[0].startswith("planning: 1/4 parts (25%), ") and "left" in lines[0]
    assert lines[-1].startswith("planning: done, 4/4 parts (100%) in ")
    quiet = io.StringIO()
    with pg.progress("planning", total=4, mode="off", every=0, stream=quiet) as bar:
        bar.advance(4)
    assert quiet.getvalue() == ""


def test_the_bar_mode_writes_a_tqdm_bar_on_the_stream():
    stream = io.StringIO()
    with pg.progress("backfill", total=40, unit="item", mode="bar", stream=stream) as bar:
        bar.advance(10)
        bar.update_to(40)
    text = stream.getvalue()
    assert "backfill: 100%|" in text and "40/40" in text and "item/s" in text, text
    assert "##########" in text  # ascii on a stream without an encoding; a terminal gets █


def test_the_mode_comes_from_the_argument_then_fastfill_progress_then_the_terminal(monkeypatch):
    piped = io.StringIO()
    monkeypatch.delenv(pg.ENV_MODE, raising=False)
    assert pg.resolve_mode(None, piped) == "log"
    assert pg.resolve_mode("bar", piped) == "bar"
    main, side = os.openpty()
    try:
        with os.fdopen(side, "w", closefd=False) as terminal:
            assert pg.resolve_mode(None, terminal) == "bar"
            monkeypatch.setenv(pg.ENV_MODE, "log")
            assert pg.resolve_mode(None, terminal) == "log"
            assert pg.resolve_mode("auto", terminal) == "bar"  # auto: the terminal decides
    finally:
        os.close(main)
        os.close(side)
    monkeypatch.setenv(pg.ENV_MODE, "off")
    assert pg.resolve_mode(None, piped) == "off"
    with pg.forced_mode("bar"):
        assert os.environ[pg.ENV_MODE] == "bar" and pg.resolve_mode(None, piped) == "bar"
    assert os.environ[pg.ENV_MODE] == "off"
    monkeypatch.delenv(pg.ENV_MODE)
    with pg.forced_mode("log"):
        assert pg.resolve_mode(None, piped) == "log"
    assert pg.ENV_MODE not in os.environ
    with pg.forced_mode(None):
        assert pg.ENV_MODE not in os.environ
    monkeypatch.setenv(pg.ENV_MODE, "sometimes")
    with pytest.warns(UserWarning, match="FASTFILL_PROGRESS='sometimes'"):
        assert pg.resolve_mode(None, piped) == "log"
    with pytest.raises(ValueError, match="one of auto, bar, log, off"):
        pg.progress("x", mode="loud")
    monkeypatch.setenv(pg.ENV_SECONDS, "0.5")
    assert pg.progress("x", mode="off").every == 0.5


def test_the_cli_maps_its_option_onto_the_mode(monkeypatch):
    from fastfill.cli.upgrade_progress import progress_mode, progress_wanted

    monkeypatch.delenv(pg.ENV_MODE, raising=False)
    assert (progress_mode(True), progress_mode(False), progress_mode(None)) == ("bar", "log", None)
    assert progress_wanted(None, io.StringIO()) is False
    monkeypatch.setenv(pg.ENV_MODE, "bar")
    assert progress_wanted(None, io.StringIO()) is True
    assert progress_wanted(False, io.StringIO()) is False


@pytest.mark.parametrize("mode", ["log", "bar"])
def test_advancing_from_many_threads_counts_every_item(mode):
    lines = []
    stream = io.StringIO()
    with pg.progress("chunks", total=8 * 500, mode=mode, log=lines.append, every=0, stream=stream) as bar:
        workers = [threading.Thread(target=lambda: [bar.advance(1) for _ in range(500)]) for _ in range(8)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert bar.done == 4000
    if mode == "log":
        assert lines[-1].startswith("chunks: done, 4,000/4,000 items (100%)")
    else:
        assert "4000/4000" in stream.getvalue()


def test_embed_reports_each_batch():
    import torch

    from fastfill.components.experiment.inference import embed
    from fastfill.components.experiment.models import Embedder
    from fastfill.components.platform.config import TrainConfig

    torch.manual_seed(0)
    model = Embedder(TrainConfig(backbone="cnn", width=4, embedding_dim=8), 1, [0, 1], 0.5, 0.25)
    images = np.random.default_rng(0).integers(0, 255, (10, 1, 16, 16), dtype=np.uint8)
    seen = []
    features = embed(model, images, batch_size=4, device=torch.device("cpu"), on_batch=seen.append)
    assert seen == [4, 4, 2]
    np.testing.assert_array_equal(features, embed(model, images, batch_size=4, device=torch.device("cpu")))


def _read_pty(main: int, process: subprocess.Popen, timeout: float) -> str:
    seen = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the other side closed (Linux: EIO)
                break
            if not chunk:
                break
            seen += chunk
        elif process.poll() is not None:
            break
    return seen.decode(errors="replace")


SCRIPT = textwrap.dedent("""
    import time
    from fastfill.components.platform.progress import progress

    with progress("embedding the map sample", total=60, unit="image") as bar:
        for _ in range(6):
            time.sleep(0.02)
            bar.advance(10)
    print("finished", flush=True)
""")


@pytest.mark.parametrize("rows, columns", [(0, 0), (24, 100)], ids=["unsized", "24x100"])
def test_a_pseudo_terminal_shows_the_bar(rows, columns):
    main, side = pty.openpty()
    if rows:
        fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in (pg.ENV_MODE, "COLUMNS", "LINES")}
    try:
        process = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=side)
        os.close(side)
        side = None
        shown = _read_pty(main, process, timeout=60)
        stdout = process.communicate(timeout=30)[0].decode()
    finally:
        os.close(main)
        if side is not None:
            os.close(side)
    assert process.returncode == 0, shown
    assert stdout == "finished\n"
    assert "embedding the map sample: 100%|" in shown and "█" in shown and "60/60" in shown, repr(shown)
    assert "done," not in shown  # a bar, not the log mode's lines
