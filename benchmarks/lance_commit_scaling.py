"""Does a Lance gallery's chunk commit stay flat as the table grows? Two galleries in one process,
``--small`` and ``--large`` rows (default 100,000 and 1,000,000), upgraded side by side through
the product's functions (adopt, commit_plan, write_chunk with the serving table's chunk commit),
their chunks interleaved in proportion so both are at the same share of their backfill at every
moment and whatever else the machine does falls on both alike:

    .venv/bin/python benchmarks/lance_commit_scaling.py
    .venv/bin/python benchmarks/lance_commit_scaling.py --small 20000 --large 200000   # a quick look

A chunk's commit is write_chunk's seconds (the chunk's features in the store, its rows in the
serving table in one commit, its marker) less the ANN index upkeep inside it (the chunk's
fragment added to the index as a delta: timed apart, reported apart). Prints the medians, the
ratio large / small and a line per tenth of the backfill; writes reports/lance_commit_scaling.{md,json}."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving_index import _data, adopt_features, chunk_ranges, commit_chunk, plan_objects  # noqa: E402


class Upgrade:
    """One gallery of ``items`` rows on the lance layout, switched to the new model, with its chunks
    to commit one at a time."""

    def __init__(self, root: str, items: int, chunk: int, old_dim: int, new_dim: int):
        from fastfill.components.gallery.layouts.opening import gallery_at, layout_of
        from fastfill.components.gallery.store import open_store
        from fastfill.components.gallery.upgrade.planning import Plan, commit_plan
        from fastfill.components.platform.config import GalleryConfig
        from fastfill.components.platform.registry import ModelRef

        self.data = _data(items, old_dim, new_dim)
        old, new = ModelRef("embedder", "1", old_dim), ModelRef("embedder", "2", new_dim)
        store = open_store(root)
        adopt_features(store, old, self.data["old"], layout_of("lance", GalleryConfig(layout="lance")))
        gallery = gallery_at(store)
        self.plan = Plan("u1", old, new, "models:/map/1", "sigma", chunk, items, 0, "l2")
        plan_objects(gallery, self.plan, self.data)
        start = time.perf_counter()
        commit_plan(gallery, self.plan, self.data["order"])
        self.switch = time.perf_counter() - start
        self.gallery = gallery_at(store)
        self.chunks = chunk_ranges(items, chunk)
        self.seconds: list[float] = []

    def commit(self, upkeep: list[float]) -> None:
        """The next chunk; its seconds less the index upkeep timed inside it."""
        number, lo, hi = self.chunks[len(self.seconds)]
        positions = self.data["order"][lo:hi]
        before = len(upkeep)
        start = time.perf_counter()
        commit_chunk(self.gallery, self.plan, number, lo, hi, positions, self.data["new"][positions], start)
        self.seconds.append(time.perf_counter() - start - sum(upkeep[before:]))

    @property
    def done(self) -> float:
        return len(self.seconds) / len(self.chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=100000)
    parser.add_argument("--large", type=int, default=1000000)
    parser.add_argument("--chunk", type=int, default=10000)
    parser.add_argument("--old-dim", type=int, default=128)
    parser.add_argument("--new-dim", type=int, default=256)
    args = parser.parse_args()
    from benchmarks.serving_index import _time_lance_index

    upkeep = _time_lance_index()
    roots = [tempfile.mkdtemp(prefix="lance-commit-") for _ in range(2)]
    try:
        small = Upgrade(roots[0], args.small, args.chunk, args.old_dim, args.new_dim)
        print(f"{args.small:,} rows switched in {small.switch:.1f} s", flush=True)
        large = Upgrade(roots[1], args.large, args.chunk, args.old_dim, args.new_dim)
        print(f"{args.large:,} rows switched in {large.switch:.1f} s", flush=True)
        upkeep.clear()
        lines, step = [], max(1, len(large.chunks) // 10)
        while large.done < 1 or small.done < 1:
            # the one further behind in its backfill goes next
            turn = small if (small.done < large.done and small.done < 1) or large.done >= 1 else large
            turn.commit(upkeep)
            if turn is large and len(large.seconds) % step == 0 and small.seconds:
                lines.append(f"{large.done:4.0%}: {args.small:,} rows {1000 * small.seconds[-1]:.1f} ms, "
                             f"{args.large:,} rows {1000 * large.seconds[-1]:.1f} ms")
                print(lines[-1], flush=True)
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    per = 10000 / args.chunk
    result = {"small": {"items": args.small, "commit_per_10k_rows_median": statistics.median(small.seconds) * per,
                        "commit_per_10k_rows_mean": statistics.mean(small.seconds) * per},
              "large": {"items": args.large, "commit_per_10k_rows_median": statistics.median(large.seconds) * per,
                        "commit_per_10k_rows_mean": statistics.mean(large.seconds) * per},
              "chunk": args.chunk, "new_dim": args.new_dim}
    result["ratio_median"] = result["large"]["commit_per_10k_rows_median"] / result["small"]["commit_per_10k_rows_median"]
    result["ratio_mean"] = result["large"]["commit_per_10k_rows_mean"] / result["small"]["commit_per_10k_rows_mean"]
    text = "\n".join([
        f"# A Lance chunk's commit at {args.small:,} and {args.large:,} rows, side by side", "",
        f"`python benchmarks/lance_commit_scaling.py --small {args.small} --large {args.large} --chunk {args.chunk}` "
        f"on 2 cores: both galleries in one process, chunks of {args.chunk:,} rows ({args.old_dim}-d -> "
        f"{args.new_dim}-d) interleaved so both are at the same share of their backfill; the index upkeep "
        "inside each commit timed apart and left out.", "",
        "| rows | commit per 10,000 rows, median | mean |", "|---|---|---|",
        *(f"| {r['items']:,} | {1000 * r['commit_per_10k_rows_median']:.1f} ms | "
          f"{1000 * r['commit_per_10k_rows_mean']:.1f} ms |" for r in (result["small"], result["large"])),
        "", f"Ratio {args.large:,} / {args.small:,}: {result['ratio_median']:.2f}x (median), "
        f"{result['ratio_mean']:.2f}x (mean).", "", "Along the backfill (the last chunk of each):", "",
        *(f"- {line}" for line in lines), ""])
    print(text)
    out = ROOT / "reports" / "lance_commit_scaling"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
