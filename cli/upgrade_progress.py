"""The upgrade's progress on the terminal: whether to show a bar (``--progress``, the
environment, a terminal), and the bar of the backfill, fed by the store's chunk markers."""

from __future__ import annotations

import sys

from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade.outcome import UpgradeResult
from fastfill.components.gallery.upgrade.status import gallery_status
from fastfill.components.platform.progress import Progress, progress, resolve_mode


def progress_wanted(progress: bool | None, stream=None) -> bool:
    """``--progress`` / ``--no-progress``; neither: FASTFILL_PROGRESS when it says ``bar`` (on),
    ``log`` or ``off`` (off), else on when stderr (``stream``) is a terminal."""
    stream = sys.stderr if stream is None else stream
    return resolve_mode(None, stream) == "bar" if progress is None else progress


def progress_mode(progress: bool | None) -> str | None:
    """What ``--progress`` / ``--no-progress`` make of FASTFILL_PROGRESS for the steps the
    command runs in this process (components.platform.progress): ``bar``, or ``log`` (lines
    through the flow's logger, no bar); neither: None, the environment decides."""
    return None if progress is None else ("bar" if progress else "log")


class ProgressBar:
    """The backfill's bar on the terminal, fed by polling the store's chunk markers, so it moves
    the same whatever runs the chunks (threads here, or Dask workers elsewhere). ``finish`` with
    the flow's result draws the final count, also when the backfill was over before the first
    poll saw it (a small gallery)."""

    def __init__(self, uri: str, enabled: bool, stream=None, interval: float = 0.5):
        import threading

        self.uri, self.enabled, self.interval = uri, enabled, interval
        self.stream = sys.stderr if stream is None else stream
        self.bar: Progress | None = None  # from the first poll that sees chunks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastfill-progress", daemon=True)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._halt()
        with self._lock:
            if self.bar is not None:
                self.bar.close()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _show(self, label: str, total: int, done: int) -> None:
        with self._lock:
            if self.bar is None:
                # counted from what was done when it was first seen: a resumed backfill's rate is this run's
                self.bar = progress(label, total=total, unit="item", mode="bar", stream=self.stream, initial=done)
            self.bar.update_to(done)

    def finish(self, result: UpgradeResult) -> None:
        """The flow's result: the bar ends at its count of backfilled items (no bar for an
        upgrade with nothing to do)."""
        self._halt()
        if not self.enabled or result.state == "up-to-date":
            return
        label = f"backfill {result.upgrade_id or ''}".rstrip()
        if self.bar is None:
            self._show(label, result.items, 0)
        self._show(label, result.items, result.items_done)

    def _run(self) -> None:
        try:
            gallery = gallery_at(open_store(self.uri))
            while not self._stop.wait(self.interval):
                state = gallery_status(gallery, failures=False, probe=False)
                info = state.upgrade
                if info is not None and info.chunks and not self._stop.is_set():
                    self._show(f"backfill {info.upgrade_id}", state.items, info.items_done or 0)
        except Exception:  # noqa: BLE001 - the bar is a convenience; the flow reports the store's errors
            return
