"""Progress of a long step (embedding, planning, a backfill): a bar on a terminal, log lines
elsewhere.

    from fastfill.components.platform.progress import progress

    with progress("embedding the map sample", total=len(images), unit="image", log=logger.info) as bar:
        features = embed(model, images, on_batch=bar.advance)

The mode, first given wins:

* ``mode=`` of ``progress``: ``"bar"``, ``"log"``, ``"off"`` or ``"auto"``;
* the environment variable ``FASTFILL_PROGRESS`` (same values; the CLI's ``--progress`` sets
  ``bar`` and ``--no-progress`` sets ``log`` for the steps it runs, see ``forced_mode``);
* ``auto``: ``bar`` when ``stream`` (stderr) is a terminal, ``log`` otherwise.

``bar`` draws a tqdm bar on ``stream``. ``log`` calls ``log`` with one line at most every
``every`` seconds (default ``FASTFILL_PROGRESS_SECONDS``, else 30), from within ``advance``, and
one at the end::

    embedding the map sample: 4,096/10,000 images (41%), 812 image/s, 5 s elapsed, about 7 s left
    embedding the map sample: done, 10,000/10,000 images (100%) in 12 s, 820 image/s

``off`` shows nothing. A ``Progress`` is safe to advance from several threads (chunks run in a
pool). No Prefect here: a flow passes its run logger's ``info`` as ``log``.

Work that says nothing as it goes (other processes, outputs appearing on disk) is followed by
polling a count of what is done::

    with progress("comparison", total=len(outputs), unit="stage", log=log) as bar, \
            following(bar, lambda: count_written(outputs), poll=10):
        run_everything()
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

MODES = ("auto", "bar", "log", "off")
ENV_MODE = "FASTFILL_PROGRESS"
ENV_SECONDS = "FASTFILL_PROGRESS_SECONDS"
DEFAULT_SECONDS = 30.0


def resolve_mode(mode: str | None = None, stream: TextIO | None = None) -> str:
    """``bar``, ``log`` or ``off``: ``mode`` when given, else ``FASTFILL_PROGRESS``, else
    ``auto`` (``bar`` when ``stream``, default stderr, is a terminal; ``log`` otherwise). A bad
    ``mode`` raises ValueError; a bad environment value warns and counts as ``auto``."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode is None:
        mode = (os.environ.get(ENV_MODE) or "auto").strip().lower()
        if mode not in MODES:
            warnings.warn(f"{ENV_MODE}={mode!r} is not one of {', '.join(MODES)}; using auto", stacklevel=3)
            mode = "auto"
    if mode != "auto":
        return mode
    stream = sys.stderr if stream is None else stream
    try:
        return "bar" if stream.isatty() else "log"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return "log"


@contextmanager
def forced_mode(mode: str | None) -> Iterator[None]:
    """Within the block, ``FASTFILL_PROGRESS`` is ``mode`` (so every ``progress`` without a mode
    of its own, here and in subprocesses started here, follows it); None changes nothing. The
    previous value comes back at the end."""
    if mode is None:
        yield
        return
    if mode not in MODES:
        raise ValueError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
    before = os.environ.get(ENV_MODE)
    os.environ[ENV_MODE] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_MODE, None)
        else:
            os.environ[ENV_MODE] = before


def _seconds_from_env() -> float:
    text = os.environ.get(ENV_SECONDS)
    if not text:
        return DEFAULT_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        warnings.warn(f"{ENV_SECONDS}={text!r} is not a number of seconds >= 0; using {DEFAULT_SECONDS:g}",
                      stacklevel=3)
        return DEFAULT_SECONDS
    return value


def format_duration(seconds: float) -> str:
    """``7 s``, ``2 min 05 s``, ``3 h 04 min``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _rate(rate: float, unit: str) -> str:
    if rate >= 100:
        return f"{rate:,.0f} {unit}/s"
    if rate >= 1 or rate == 0:
        return f"{rate:.1f} {unit}/s"
    return f"{1 / rate:.1f} s/{unit}"


def _terminal_shape(stream: TextIO) -> tuple[int | None, int | None]:
    """(columns, rows) for tqdm: (None, None) to let it ask the terminal itself; the environment's
    COLUMNS and LINES (else 80 x 24) where the terminal reports a size of 0. A pseudo-terminal
    that nobody sized (``os.openpty``, some CI runners and container shells) reports 0 x 0, and
    tqdm then hides its bar entirely (it thinks it has no row to draw on)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None, None
    if size.columns > 0 and size.lines > 1:
        return None, None

    def number(name: str, default: int) -> int:
        try:
            return max(int(os.environ.get(name, "")), 1)
        except ValueError:
            return default

    return (size.columns if size.columns > 0 else number("COLUMNS", 80)), number("LINES", 24)


class Progress:
    """How far a step is; see the module's docstring. Made by ``progress``; used as a context
    manager or closed with ``close``.

    ``advance(k)`` adds ``k`` done items, ``update_to(n)`` sets the count (for a caller that polls
    a total), ``set_total(n)`` changes the total. ``initial``: items already done before this
    step started (a resumed backfill): counted in done/total, not in the rate."""

    def __init__(self, label: str, total: int | None = None, *, unit: str = "item", mode: str | None = None,
                 log: Callable[[str], None] | None = None, every: float | None = None, stream: TextIO | None = None,
                 initial: int = 0, clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.unit = label, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.mode = resolve_mode(mode, self.stream)
        self.every = _seconds_from_env() if every is None else float(every)
        self._log = log if log is not None else self._print
        self._clock = clock
        self._lock = threading.Lock()
        self.done = self.initial = int(initial)
        self._started = self._last_line = clock()
        self._closed = False
        self._bar = None
        if self.mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # no tqdm: lines instead of a bar
                self.mode = "log"
            else:
                ncols, nrows = _terminal_shape(self.stream)
                self._bar = tqdm(total=total, initial=self.done, desc=label, unit=unit, file=self.stream,
                                 ncols=ncols, nrows=nrows, leave=True)

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    # -- what a step calls ------------------------------------------------------------------

    def advance(self, count: int = 1) -> None:
        """``count`` more items done (from any thread)."""
        with self._lock:
            if self._closed:
                return
            self.done += int(count)
            if self._bar is not None:
                self._bar.update(int(count))
            elif self.mode == "log":
                self._maybe_log()

    def update_to(self, done: int) -> None:
        """The count of done items is now ``done`` (from any thread)."""
        with self._lock:
            if self._closed:
                return
            if self._bar is not None and done != self.done:
                self._bar.update(int(done) - self.done)
            self.done = int(done)
            if self._bar is None and self.mode == "log":
                self._maybe_log()

    def set_total(self, total: int | None) -> None:
        with self._lock:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()

    def close(self, failed: bool = False) -> None:
        """The end: the bar's last state, or a last log line (``failed``: "stopped at" instead of
        "done"). Closing twice does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._bar.close()
            elif self.mode == "log":
                self._log(self.line(final=True, failed=failed))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(failed=kind is not None)

    # -- the log line ------------------------------------------------------------------------

    def _maybe_log(self) -> None:
        now = self._clock()
        if now - self._last_line >= self.every:
            self._last_line = now
            self._log(self.line(now))

    def line(self, now: float | None = None, *, final: bool = False, failed: bool = False) -> str:
        """The log line as things stand: done/total, percent, rate and time left (or, ``final``,
        the duration)."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._started, 0.0)
        new = self.done - self.initial
        rate = new / elapsed if elapsed > 0 else 0.0
        units = self.unit if self.unit.endswith("s") else f"{self.unit}s"
        count = f"{self.done:,}/{self.total:,} {units}" if self.total else f"{self.done:,} {units}"
        if self.total:
            count += f" ({100 * self.done / self.total:.0f}%)"
        if final:
            return f"{self.label}: {'stopped at' if failed else 'done,'} {count} in {format_duration(elapsed)}, " \
                   f"{_rate(rate, self.unit)}"
        text = f"{self.label}: {count}, {_rate(rate, self.unit)}, {format_duration(elapsed)} elapsed"
        if self.total and rate > 0:
            text += f", about {format_duration(max(self.total - self.done, 0) / rate)} left"
        elif self.total:
            text += ", time left unknown"
        return text


def progress(label: str, total: int | None = None, *, unit: str = "item", mode: str | None = None,
             log: Callable[[str], None] | None = None, every: float | None = None, stream: TextIO | None = None,
             initial: int = 0) -> Progress:
    """A ``Progress`` of the step ``label`` over ``total`` items (None: unknown), to use as a
    context manager::

        with progress("backfill", total=items, unit="item", log=logger.info, initial=already) as bar:
            for future in as_completed(chunks):
                bar.advance(future.result())

    ``mode``: ``bar``, ``log``, ``off`` or ``auto`` (None: ``FASTFILL_PROGRESS``, else auto: a
    bar when ``stream`` is a terminal). ``log``: where the log mode's lines go (default: printed
    on ``stream``, stderr). ``every``: the least number of seconds between two log lines
    (default ``FASTFILL_PROGRESS_SECONDS``, else 30); the end always has a line. ``initial``:
    items done before this step began (counted, but not in the rate)."""
    return Progress(label, total, unit=unit, mode=mode, log=log, every=every, stream=stream, initial=initial)


@contextmanager
def following(bar: Progress, count: Callable[[], int], *, poll: float = 10.0) -> Iterator[Progress]:
    """While the block runs, a thread of its own sets ``bar`` to ``count()`` every ``poll``
    seconds (so the log mode also gets its periodic lines while nothing changes), and once more
    when the block ends, before the caller closes ``bar``. The thread runs in a copy of the
    caller's context, so a ``log`` that needs the caller's run (Prefect's run logger) works there.
    A ``count`` that raises skips that poll: following never stops the work it follows."""
    stop = threading.Event()

    def poll_count() -> None:
        try:
            bar.update_to(count())
        except Exception as error:  # noqa: BLE001 - progress is never worth stopping the work
            warnings.warn(f"{bar.label}: could not count what is done ({error})", stacklevel=2)

    def watch() -> None:
        while not stop.wait(poll):
            poll_count()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True,
                              name=f"progress of {bar.label}")
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        poll_count()
