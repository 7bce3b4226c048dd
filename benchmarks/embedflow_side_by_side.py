"""EmbedFlow itself, side by side with the product, on one run's data.

    .venv/bin/pip install --no-deps 'embedflow==0.8.0'     # the optional extra (AGPL; never a product dependency)
    .venv/bin/python benchmarks/embedflow_side_by_side.py [--run runs/rerank/n-all/seed-0] [--depth 50] [--sync 4]

EmbedFlow (``embedflow.serving.engine.MigrationEngine``) serves a migration by candidate
reranking: the old model's query searches the old index for K candidates, the new model's query
ranks those whose new vectors its cache holds, up to ``max_sync_misses`` misses are embedded on
the query path, the rest are queued for its background worker. This script runs its engine,
unchanged, over a FAISS index (its ``FaissIndex``) of the old gallery (the run's 10,000 test
images), with the run's two trained CNNs wrapped in its encoder interface, and streams test
queries (--queries, 2,000 by default) through ``engine.search`` in a random order while its
worker thread fills the cache: its own query-driven filling, in real time. The query's own item
is left out of its answer, as the protocol leaves it out (one more candidate, and one more
synchronous slot while that item has no new vector: it is the old index's nearest).

Its interface takes text: a document is an id string, and the wrapped encoders embed the image
with that id (the CNN on the image, per call). Its scores are inner products (higher first),
while the product measures squared l2 on these features: the wrapped encoders add one
coordinate so that the inner product ranks exactly as l2 does (the item ``[x, -|x|^2 / 2]``,
the query ``[q, 1]``: their product is ``(|q|^2 - |q - x|^2) / 2``).

Measured, per window of 1,000 queries: its top-1 (its first result of the query's class), the
share of the gallery its cache holds at the window's end, and its wall time per query (median,
95th percentile, and its own stage timings). Against it, on the same data: the product's
measure of the same method (``rerank_curves`` with the cache's contents as the backfilled set,
which must give the same top-1 where its cache did not change during the query) and FastFill's
serving path (one embedding by the new model and one FAISS search of the gallery) timed the same
way. Writes reports/embedflow_side_by_side.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _encoder(model, images: np.ndarray, name: str, dimension: int):
    """A model in EmbedFlow's encoder interface: ids in, vectors out, the l2 coordinate added."""
    import torch
    from embedflow.models.base import EmbeddingModel

    from fastfill.components.experiment.inference import embed

    device = torch.device("cpu")

    class Encoder(EmbeddingModel):
        model_id, fingerprint = name, f"fastfill-{name}"

        def __init__(self) -> None:
            self.dimension = dimension + 1
            self.calls = 0

        def _features(self, texts: list[str]) -> np.ndarray:
            self.calls += len(texts)
            rows = np.array([int(t.removeprefix("img-")) for t in texts])
            return embed(model, images[rows], device=device)

        def encode_queries(self, texts):
            x = self._features(list(texts))
            return np.hstack([x, np.ones((len(x), 1), dtype=np.float32)])

        def encode_documents(self, texts, batch_size=None):
            x = self._features(list(texts))
            return np.hstack([x, -0.5 * np.einsum("ij,ij->i", x, x)[:, None]]).astype(np.float32)

        def close(self) -> None:
            return None

    return Encoder()


def _engine(workdir: Path, old_encoder, new_encoder, old_features: np.ndarray, ids: list[str], depth: int, sync: int):
    from embedflow.cache import SQLiteVectorCache
    from embedflow.config import EmbedFlowConfig, ModelConfig
    from embedflow.indexes.faiss_backend import FaissIndex
    from embedflow.migration.state import DocumentStore
    from embedflow.serving.engine import MigrationEngine

    documents = workdir / "documents.jsonl"
    documents.write_text("".join(json.dumps({"id": i, "text": i}) + "\n" for i in ids))
    cfg = EmbedFlowConfig(source=ModelConfig(old_encoder.model_id, dimension=old_encoder.dimension),
                          target=ModelConfig(new_encoder.model_id, dimension=new_encoder.dimension))
    cfg.migration.candidate_depth, cfg.migration.max_sync_misses = depth, sync
    cfg.cache.path, cfg.state_path = str(workdir / "cache"), str(workdir / "state.json")
    cfg.telemetry.latency_log = str(workdir / "latency.jsonl")
    x = old_features
    gallery = np.hstack([x, -0.5 * np.einsum("ij,ij->i", x, x)[:, None]]).astype(np.float32)
    index = FaissIndex.build(gallery, ids, metric="dot")
    cache = SQLiteVectorCache(workdir / "cache", new_encoder.fingerprint, new_encoder.dimension)
    return MigrationEngine(cfg, old_encoder, new_encoder, index, cache, DocumentStore(documents))


def fastfill_serving_times(new_model, images: np.ndarray, gallery: np.ndarray, queries: np.ndarray) -> list[float]:
    """FastFill's query path, timed per query: the new model embeds the query image, one FAISS
    search (flat, l2) of the gallery (its mapped and backfilled features)."""
    import faiss
    import torch

    from fastfill.components.experiment.inference import embed

    index = faiss.IndexFlatL2(gallery.shape[1])
    index.add(gallery)
    times = []
    for q in queries:
        start = time.perf_counter()
        feature = embed(new_model, images[q:q + 1], device=torch.device("cpu"))
        index.search(feature, 10)
        times.append(1000 * (time.perf_counter() - start))
    return times


def _ms(values: list[float]) -> dict:
    return {"median": statistics.median(values), "p95": float(np.percentile(values, 95)), "mean": statistics.fmean(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=Path("runs/rerank/n-all/seed-0"))
    parser.add_argument("--depth", type=int, default=50, help="EmbedFlow's candidate_depth (its default 50)")
    parser.add_argument("--sync", type=int, default=4, help="EmbedFlow's max_sync_misses (its default 4)")
    parser.add_argument("--queries", type=int, default=2000,
                        help="test queries streamed (its worker fills the cache within the first few hundred)")
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    args = parser.parse_args(argv)
    try:
        import embedflow
    except ImportError:
        print("EmbedFlow is not installed: `.venv/bin/pip install --no-deps 'embedflow==0.8.0'` (an optional extra of "
              "the benchmarks, AGPL-3.0; never a dependency of the product)", file=sys.stderr)
        return 2
    import torch

    from fastfill.components.experiment.data import load_split
    from fastfill.components.experiment.models import load_embedder

    torch.set_num_threads(1)
    run = args.run
    split = load_split(run.parent / "data" / "splits", "test")
    labels, images = split.labels, split.images
    old_model = load_embedder(run / "artifacts" / "models" / "old" / "model.pt").eval()
    new_model = load_embedder(run / "artifacts" / "models" / "new" / "model.pt").eval()
    old_features = np.load(run / "artifacts" / "features" / "old" / "test.npy")
    new_features = np.load(run / "artifacts" / "features" / "new" / "test.npy")
    mapped = np.load(run / "artifacts" / "align" / "fastfill" / "gallery_old.npy")
    n = len(labels)
    ids = [f"img-{i}" for i in range(n)]
    stream = np.random.default_rng(args.seed).permutation(n)[:args.queries]
    old_encoder = _encoder(old_model, images, "old", old_features.shape[1])
    new_encoder = _encoder(new_model, images, "new", new_features.shape[1])
    workdir = Path(tempfile.mkdtemp(prefix="embedflow-"))
    engine = _engine(workdir, old_encoder, new_encoder, old_features, ids, args.depth, args.sync)
    records: list[dict] = []
    snapshots: list[list[int]] = []  # the cache's items at each window's end
    try:
        started = time.perf_counter()
        for count, q in enumerate(stream, 1):
            before = engine.cache.stats()["cached_target_vectors"]
            # the protocol leaves the query's own item out: it is the old index's nearest item, so
            # one more candidate, and one more synchronous slot when it has no new vector yet (it
            # is the first miss in the old order); then it is dropped from the answer
            own_missing = not engine.cache.peek([ids[q]])
            t0 = time.perf_counter()
            answer = engine.search(ids[q], top_k=11, candidate_depth=args.depth + 1,
                                   max_sync_misses=args.sync + (own_missing and args.sync > 0))
            wall = 1000 * (time.perf_counter() - t0)
            after = engine.cache.stats()["cached_target_vectors"]
            results = [r["id"] for r in answer["results"] if r["id"] != ids[q]]
            first = results[0] if results else None
            records.append({"query": int(q), "wall_ms": wall, "top1": bool(first is not None and
                                                                         labels[int(first[4:])] == labels[q]),
                            "first": first, "cached_before": before, "cached_after": after,
                            "status": answer["migration"]["status"], "timing": answer["timing_ms"],
                            "sync": answer["migration"]["sync_misses_encoded"] - (own_missing and args.sync > 0)})
            if count % args.window == 0 or count == len(stream):
                snapshots.append(sorted(int(i[4:]) for i in engine.cache.peek(ids)))
            if count % args.window == 0:
                recent = records[-args.window:]
                print(f"{count} queries ({time.perf_counter() - started:.0f} s): top-1 "
                      f"{100 * statistics.fmean(r['top1'] for r in recent):.2f}%, cache {after} of {n}, median "
                      f"{statistics.median(r['wall_ms'] for r in recent):.2f} ms", flush=True)
        stream_seconds = time.perf_counter() - started
        stream_calls = {"old": old_encoder.calls, "new": new_encoder.calls}
        cached_ids = sorted(int(i[4:]) for i in engine.cache.get(ids).keys())
    finally:
        engine.worker.close(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)

    windows = []
    for start in range(0, len(records), args.window):
        window = records[start:start + args.window]
        windows.append({"queries": len(window), "top1": statistics.fmean(r["top1"] for r in window),
                        "cache_end": window[-1]["cached_after"] / n,
                        "wall_ms": _ms([r["wall_ms"] for r in window]),
                        "stages_ms": {k: statistics.fmean(r["timing"][k] for r in window) for k in window[0]["timing"]},
                        "sync_per_query": statistics.fmean(r["sync"] for r in window)})
    # The product's measure of the same method on the same state: a fresh engine whose cache holds
    # exactly the final cache's items answers 1,000 probe queries with no synchronous budget; the
    # product measures candidate reranking with those items backfilled
    in_cache = np.zeros(n, dtype=bool)
    in_cache[cached_ids] = True
    order = np.concatenate([np.flatnonzero(in_cache), np.flatnonzero(~in_cache)])
    ours = _rerank_at(old_features, new_features, labels, order, len(cached_ids), args.depth)
    probe = np.random.default_rng(args.seed + 1).permutation(n)[:1000]
    final_dir = Path(tempfile.mkdtemp(prefix="embedflow-final-"))
    theirs = []
    try:
        final = _engine(final_dir, old_encoder, new_encoder, old_features, ids, args.depth, 0)
        final.worker.stop()  # nothing more enters its cache
        final.cache.put([ids[i] for i in cached_ids], new_encoder.encode_documents([ids[i] for i in cached_ids]))
        for q in probe:
            answer = final.search(ids[q], top_k=2, candidate_depth=args.depth + 1, max_sync_misses=0)
            first = next(r["id"] for r in answer["results"] if r["id"] != ids[q])
            theirs.append(bool(labels[int(first[4:])] == labels[q]))
        final.worker.close(timeout=30)
    finally:
        shutil.rmtree(final_dir, ignore_errors=True)
    coverage = len(cached_ids) / n
    agree, checked = int(np.sum(np.asarray(theirs) == ours[probe])), len(probe)
    # along its filling, at each window's end: the product's measure of the same method on the
    # cache as it stood (top-1 and mAP over the 10,000 queries), and FastFill-sigma with as many
    # items backfilled
    from fastfill.components.evaluation import curve_at_counts
    from fastfill.components.evaluation.ordering import random_order, sigma_order
    from fastfill.components.evaluation.rerank import RerankVariant, rerank_curves

    sigma_file = run / "artifacts" / "align" / "fastfill" / "log_sigma2.npy"
    check = run / "artifacts" / "align" / "fastfill" / "check.json"
    fallback = check.is_file() and json.loads(check.read_text()).get("fallback_order", {}).get("order") == "random"
    fastfill_order = (sigma_order(np.load(sigma_file)) if sigma_file.is_file() and not fallback
                      else random_order(n, 0))
    variant = RerankVariant(args.depth, args.sync)
    for window, snapshot in zip(windows, snapshots):
        held = np.zeros(n, dtype=bool)
        held[snapshot] = True
        filled = np.concatenate([np.flatnonzero(held), np.flatnonzero(~held)])
        curve = rerank_curves(old_features, new_features, old_features, new_features, labels, filled,
                              variants=[variant], counts=[len(snapshot)])[variant]
        fastfill = curve_at_counts(new_features, new_features, mapped, labels, fastfill_order, [len(snapshot)])
        window["product_measure"] = {"top1": float(curve.top1[0]), "map": float(curve.map[0])}
        window["fastfill_same_count"] = {"top1": float(fastfill.top1[0]), "map": float(fastfill.map[0]),
                                         "order": "random (its map check fell back)" if fallback else "sigma"}
    ff_times = fastfill_serving_times(new_model, images, mapped, stream[:1000])
    summary = {"run": str(run), "embedflow": embedflow.__version__ if hasattr(embedflow, "__version__") else "0.8.0",
               "depth": args.depth, "sync": args.sync, "queries": len(records), "stream_seconds": stream_seconds,
               "windows": windows, "final_cache": coverage,
               "embedflow_top1_on_final_cache": statistics.fmean(map(float, theirs)),
               "product_top1_on_final_cache": float(ours[probe].mean()),
               "agreement": {"queries": checked, "same_top1_hit": agree},
               "embedflow_wall_ms": _ms([r["wall_ms"] for r in records]),
               "fastfill_wall_ms": _ms(ff_times),
               "encoder_calls": stream_calls}
    args.reports.mkdir(parents=True, exist_ok=True)
    (args.reports / "embedflow_side_by_side.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.reports / "embedflow_side_by_side.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


def _rerank_at(old, new, labels, order, count: int, depth: int) -> np.ndarray:
    """Top-1 hit per query of candidate reranking with the first ``count`` of ``order``
    backfilled, no budget (the product's measure)."""
    from fastfill.components.evaluation.rerank import RerankVariant, rerank_curves

    variant = RerankVariant(depth)
    top1, _ = rerank_curves(old, new, old, new, labels, order, variants=[variant], counts=[count],
                            per_query=True)[variant]
    return np.asarray(top1[0])


def markdown(s: dict) -> str:
    lines = ["# EmbedFlow itself, side by side", "",
             f"EmbedFlow {s['embedflow']}'s `MigrationEngine` over its `FaissIndex` of the old gallery ({s['run']}: the "
             f"test split's 10,000 images, the run's old and new CNNs wrapped in its encoder interface), "
             f"candidate_depth {s['depth']}, max_sync_misses {s['sync']}, its background worker filling the cache "
             f"while {s['queries']} test queries stream through `engine.search` in a random order "
             f"({s['stream_seconds']:.0f} s). One thread for the models.", "",
             "Per window of queries: its top-1 on the window's queries as it answered them; at the window's end, its "
             "cache's share of the gallery, and on that cache the product's measure of the same method (every test "
             "query, top-1 and mAP) and FastFill with as many items backfilled (its map, the run's order).", "",
             "| queries | its top-1 (served) | cache at the end | reranking on that cache: top-1 / mAP | FastFill, as "
             "many backfilled: top-1 / mAP | item embeddings on the query path | median ms | p95 ms |",
             "|---|---|---|---|---|---|---|---|"]
    done = 0
    for w in s["windows"]:
        done += w["queries"]
        ours, ff = w["product_measure"], w["fastfill_same_count"]
        lines.append(f"| {done - w['queries'] + 1}-{done} | {100 * w['top1']:.2f} | {100 * w['cache_end']:.1f}% | "
                     f"{100 * ours['top1']:.2f} / {100 * ours['map']:.2f} | {100 * ff['top1']:.2f} / "
                     f"{100 * ff['map']:.2f} | {w['sync_per_query']:.2f} | {w['wall_ms']['median']:.2f} | "
                     f"{w['wall_ms']['p95']:.2f} |")
    e, f = s["embedflow_wall_ms"], s["fastfill_wall_ms"]
    a = s["agreement"]
    lines += ["", f"On the final cache ({100 * s['final_cache']:.1f}% of the gallery), 1,000 probe queries with no "
              f"synchronous budget: EmbedFlow's top-1 {100 * s['embedflow_top1_on_final_cache']:.2f}%, the product's "
              f"measure of the same method {100 * s['product_top1_on_final_cache']:.2f}%; the same top-1 hit on "
              f"{a['same_top1_hit']} of {a['queries']} queries.", "",
              f"Wall time per query: EmbedFlow median {e['median']:.2f} ms (p95 {e['p95']:.2f}, mean {e['mean']:.2f}); "
              f"FastFill's serving path (the new model embeds the query, one flat FAISS search of the 10,000 items) "
              f"median {f['median']:.2f} ms (p95 {f['p95']:.2f}, mean {f['mean']:.2f}): ratio "
              f"{e['median'] / f['median']:.1f}x at the median.",
              f"Encoder calls during the stream: old model {s['encoder_calls']['old']} (the queries), new model "
              f"{s['encoder_calls']['new']} (the queries, the items embedded on the query path and the worker's).", ""]
    stages = s["windows"][0]["stages_ms"]
    lines.append("Its own stage timings, first window (ms, mean): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()) + ".")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
