"""A team's readers during an upgrade, for benchmarks/serving_index.py: ``count`` threads that
query the gallery's index the way a service does while the upgrade writes it.

Each reader holds a gallery of its own (its own connection, as a service's pool gives each worker
one) and the product's ``IndexSearch`` over it, and queries it back to back, k = 10, with query
vectors of the space the index serves (the old model's before the switch, the new one's after).
When the index moves to another space (the switch, a finish) the search says so; the reader then
reads the serving model again and asks once more, as a service would: such a retry is counted,
not as an error. Any other exception is an error. The benchmark names the phase (before the
switch, during it, the backfill, half way through it, the finish, after it); each answer's latency
is recorded under the phase it started in.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import numpy as np


class Readers:
    def __init__(self, count: int, open_gallery, queries: dict[int, np.ndarray], k: int = 10):
        """``open_gallery()``: a fresh gallery of the store; ``queries``: query vectors by dimension."""
        self.count, self.open_gallery, self.queries, self.k = count, open_gallery, queries, k
        self.phase = "idle"
        self.stopping = threading.Event()
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, list[str]] = defaultdict(list)
        self.retries: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.ready = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._read, args=(n,), daemon=True) for n in range(count)]

    def start(self) -> Readers:
        """The readers started, each with its searcher open (imports and connections before any
        phase is timed)."""
        from fastfill.components.gallery.search.served import IndexSearch  # noqa: F401 - imported once, here

        for thread in self.threads:
            thread.start()
        for _ in self.threads:
            self.ready.acquire(timeout=300)
        return self

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def close(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _read(self, number: int) -> None:
        from fastfill.components.gallery.layouts.catalog import GalleryError
        from fastfill.components.gallery.search.served import IndexSearch

        rng = np.random.default_rng([number, 63])
        searcher = None
        try:
            searcher = IndexSearch(self.open_gallery())
        except Exception:  # noqa: BLE001 - the reader opens it again in its loop, where a failure is counted
            searcher = None
        self.ready.release()
        while not self.stopping.is_set():
            phase = self.phase
            if phase == "idle":
                time.sleep(0.01)
                continue
            started = time.perf_counter()
            try:
                if searcher is None:
                    searcher = IndexSearch(self.open_gallery())
                pool = self.queries[int(searcher.query_model.dim)]
                query = pool[rng.integers(len(pool))][None]
                try:
                    searcher.search(query, self.k)
                except GalleryError as error:
                    if "switched" not in str(error):
                        raise
                    with self.lock:
                        self.retries[phase] += 1
                    searcher.refresh()
                    pool = self.queries[int(searcher.query_model.dim)]
                    searcher.search(pool[rng.integers(len(pool))][None], self.k)
                elapsed = time.perf_counter() - started
                with self.lock:
                    self.latencies[phase].append(elapsed)
            except Exception as error:  # noqa: BLE001 - every failure a reader sees is the measurement
                with self.lock:
                    self.errors[phase].append(f"{type(error).__name__}: {' '.join(str(error).split())[:200]}")
                searcher = None
                time.sleep(0.05)

    def summary(self) -> dict:
        """Per phase: the answers, their latency p50/p95/p99 in ms, the retries after a move of the
        index, the errors and the first of them."""
        out = {}
        for phase in sorted(set(self.latencies) | set(self.errors), key=PHASES.index):
            values = np.asarray(self.latencies.get(phase, []), dtype=np.float64) * 1000
            out[phase] = {"answers": int(len(values)), "errors": len(self.errors.get(phase, [])),
                          "retries": int(self.retries.get(phase, 0)),
                          **({"first_error": self.errors[phase][0]} if self.errors.get(phase) else {}),
                          **({f"p{q}_ms": float(np.percentile(values, q)) for q in (50, 95, 99)} if len(values) else {})}
        return out


PHASES = ["before the switch", "the switch", "the backfill", "half way", "the finish", "after the finish"]


def readers_table(results: dict, layouts: list[str]) -> list[str]:
    """The report's lines for the readers of each layout that had them."""
    with_readers = [layout for layout in layouts if results[layout].get("readers")]
    if not with_readers:
        return []
    count = results[with_readers[0]]["readers"]["count"]
    lines = ["", f"{count} concurrent readers (threads, each with its own connection), k = 10: latency ms p50 / p95 / "
             "p99, answers, errors (retries after the index moved to another space)", "",
             "| phase | " + " | ".join(with_readers) + " |", "|---|" + "---|" * len(with_readers)]
    for phase in PHASES:
        cells = []
        for layout in with_readers:
            seen = results[layout]["readers"]["phases"].get(phase)
            if not seen:
                cells.append("-")
                continue
            latency = (f"{seen['p50_ms']:.1f} / {seen['p95_ms']:.1f} / {seen['p99_ms']:.1f}" if seen["answers"]
                       else "no answer")
            cells.append(f"{latency}, {seen['answers']:,}, {seen['errors']} ({seen['retries']})")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    errors = [f"{layout}, {phase}: {seen['first_error']}" for layout in with_readers
              for phase, seen in results[layout]["readers"]["phases"].items() if seen.get("first_error")]
    if errors:
        lines += ["", "First error of each phase: " + "; ".join(errors) + "."]
    lines += ["", "How much the readers slow the upgrade (the same layout, same data, run first without readers: the "
              "tables above): " + "; ".join(
                  f"{layout}: chunk commit median {_ratio(results[layout], 'chunk_commit_median')}, switch "
                  f"{_ratio(results[layout], 'switch')}, finish {_ratio(results[layout], 'finish')}"
                  for layout in with_readers) + "."]
    return lines


def _ratio(result: dict, step: str) -> str:
    alone, read = result["times"][step], result["readers"]["times"][step]
    return f"{read:.3f} s against {alone:.3f} s ({read / alone:.2f}x)"
