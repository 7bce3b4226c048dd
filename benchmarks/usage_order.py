"""Does a backfill that follows the queries pay off? The usage orders (``usage``: most-hit items
first; ``usage_sigma``: usage weight x sigma^2 first, then sigma) against FastFill's sigma order
and random, on the pipeline's own outputs, under simulated query workloads.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/usage_order.py --seeds 0 1 2

Inputs (what `fastfill run` leaves): artifacts/features/{old,new}/test.npy,
artifacts/align/fastfill/{gallery_old,log_sigma2}.npy (h(old) of the test split and its
predicted log sigma^2), data/splits/test_labels.npy. Writes reports/usage_order.{md,json}.

Per workload seed:
- The test split is gallery and query set, as in the evaluation protocol. Its items are split at
  random into two halves: the log's queries come from one, the evaluation's from the other, so no
  evaluated query is in the log (except for the ``item, repeated`` workload, below).
- A workload is a distribution over query items: ``uniform``; ``class``: Zipf over the classes
  (exponent s, the classes' ranks drawn by the seed), uniform within a class; ``item, new``: Zipf
  over the items (s, ranks drawn by the seed), each half drawing from its own items;
  ``item, repeated``: the same, both draws from every item (popular items are asked again).
- The query log: ``--log-queries`` draws (default n / 2); each logged query's hits are the top-10
  gallery items it retrieves with the old model (old query, old gallery, itself excluded): what
  production logs show before the upgrade. The log is written as a Parquet file (query, hit) and
  counted by the product (``components.gallery.upgrade.usage.load_usage_log``).
- Evaluation: ``--eval-queries`` draws from the workload on the other half; each backfill order's
  curve is ``per_query_curve`` (new queries against the mixed gallery of new and transformed old
  features, 22 points, the protocol of ``backfill_curve``), and each point's top-1 is the mean over
  the drawn queries (a query drawn k times counts k times).
- The shadow index, what teams do without a map (``shadow, random`` and ``shadow, usage``: most-hit
  first, ties by position, as a team without sigma has them): ``dual_curves(per_query=True)``
  with rrf, the old query against the old features of the items not yet re-embedded and the new
  query against the new features of those that are, weighted by the same draws.
Reported: top1_auc (the plain mean of the 22 points) and the mean top-1 over the first 30% of the
backfill (trapezoid on the curve's points, linear at 30%), mean ± standard deviation over seeds.
``--subset`` repeats everything on a random subset of the gallery (queries = gallery = subset).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastfill.components.evaluation import curve_alphas, per_query_curve  # noqa: E402
from fastfill.components.evaluation.dual_curve import dual_curves  # noqa: E402
from fastfill.components.evaluation.ordering import random_order  # noqa: E402
from fastfill.components.gallery.upgrade.usage import backfill_order, load_usage_log  # noqa: E402

WORKLOADS = ("uniform", "class", "item, new", "item, repeated")
ORDERS = ("random", "sigma", "usage", "usage_sigma")  # the map's way (FastFill's h(old) until re-embedded)
SHADOW = ("shadow, random", "shadow, usage")  # the shadow index (dual_rrf, no map): what teams do
EARLY = 0.3  # the front of the backfill reported on its own


def load_outputs(root: Path) -> dict:
    arrays = {"old": "artifacts/features/old/test.npy", "new": "artifacts/features/new/test.npy",
              "transformed": "artifacts/align/fastfill/gallery_old.npy",
              "log_sigma2": "artifacts/align/fastfill/log_sigma2.npy", "labels": "data/splits/test_labels.npy"}
    missing = [path for path in arrays.values() if not (root / path).is_file()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: run `fastfill run` first")
    data = {name: np.load(root / path) for name, path in arrays.items()}
    n = len(data["labels"])
    if any(len(a) != n for a in data.values()):
        sys.exit(f"the inputs disagree on the number of test items: { {k: len(a) for k, a in data.items()} }")
    return data


def subset(data: dict, size: int, seed: int) -> dict:
    keep = np.sort(np.random.default_rng([seed, 1000]).choice(len(data["labels"]), size=size, replace=False))
    return {name: array[keep] for name, array in data.items()}


def zipf(ranks: np.ndarray, s: float) -> np.ndarray:
    return (ranks + 1.0) ** -s


def workload(kind: str, labels: np.ndarray, pool: np.ndarray, ranks: dict, s: float) -> np.ndarray:
    """Probabilities over the items: ``kind`` restricted to the boolean ``pool``."""
    if kind == "uniform":
        p = np.ones(len(labels))
    elif kind == "class":
        class_p = zipf(ranks["class"], s)
        in_pool = np.bincount(labels[pool], minlength=len(class_p)).astype(np.float64)
        p = class_p[labels] / np.maximum(in_pool[labels], 1)
    else:
        p = zipf(ranks["item"], s)
    p = np.where(pool, p, 0.0)
    return p / p.sum()


def top10_old(old: np.ndarray, queries: np.ndarray, k: int = 10, block: int = 1024) -> np.ndarray:
    """The k nearest gallery items (l2, old features) of each query item, itself excluded."""
    old = old.astype(np.float32)
    norms = (old * old).sum(1)
    out = np.empty((len(queries), k), dtype=np.int64)
    for start in range(0, len(queries), block):
        rows = queries[start:start + block]
        d = norms[rows, None] + norms[None] - 2.0 * old[rows] @ old.T
        d[np.arange(len(rows)), rows] = np.inf
        near = np.argpartition(d, k, axis=1)[:, :k]
        out[start:start + len(rows)] = near
    return out


def logged_weights(old: np.ndarray, p_log: np.ndarray, count: int, rng, folder: Path) -> np.ndarray:
    """Draw ``count`` logged queries from ``p_log``, write their top-10 old-model hits as a query
    log (Parquet: query, hit) and count it as the product does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    drawn = rng.choice(len(p_log), size=count, p=p_log)
    unique, inverse = np.unique(drawn, return_inverse=True)
    hits = top10_old(old, unique)[inverse]  # (count, 10)
    path = folder / "log.parquet"
    pq.write_table(pa.table({"query": np.repeat(np.arange(count), hits.shape[1]), "hit": hits.ravel()}), path)
    return load_usage_log(str(path), np.arange(len(p_log))).weights


def early_mean(alphas: np.ndarray, top1: np.ndarray, stop: float = EARLY) -> float:
    """Mean top-1 over the backfill fractions 0..stop: the trapezoid area to ``stop`` (linear
    between the curve's points) divided by ``stop``."""
    inside = alphas < stop
    xs = np.append(alphas[inside], stop)
    ys = np.append(top1[inside], np.interp(stop, alphas, top1))
    return float(np.trapezoid(ys, xs) / stop)


def run(data: dict, seeds: list[int], s: float, log_queries: int, eval_queries: int, curve_cache: dict,
        workloads=WORKLOADS) -> dict:
    n = len(data["labels"])
    alphas = curve_alphas()

    def curve(order: np.ndarray) -> np.ndarray:
        key = order.tobytes()
        if key not in curve_cache:
            curve_cache[key] = per_query_curve(data["new"], data["new"], data["transformed"], data["labels"],
                                               order)[0].astype(np.float64)
        return curve_cache[key]

    def shadow(order: np.ndarray) -> np.ndarray:
        key = b"shadow" + order.tobytes()
        if key not in curve_cache:
            curve_cache[key] = dual_curves(data["old"], data["new"], data["old"], data["new"], data["labels"], order,
                                           merges=["rrf"], per_query=True)["rrf"][0].astype(np.float64)
        return curve_cache[key]

    results: dict = {w: {o: [] for o in ORDERS + SHADOW} for w in workloads}
    hit_share: dict = {w: [] for w in workloads}
    sigma = backfill_order("sigma", n, 0, data["log_sigma2"])
    with tempfile.TemporaryDirectory() as folder:
        for seed in seeds:
            rng = np.random.default_rng(seed)
            ranks = {"class": rng.permutation(int(data["labels"].max()) + 1), "item": rng.permutation(n)}
            halves = rng.permutation(n)
            log_pool, eval_pool = np.zeros(n, bool), np.zeros(n, bool)
            log_pool[halves[: n // 2]], eval_pool[halves[n // 2:]] = True, True
            everything = np.ones(n, bool)
            for kind in workloads:
                repeated = kind == "item, repeated"
                p_log = workload(kind, data["labels"], everything if repeated else log_pool, ranks, s)
                p_eval = workload(kind, data["labels"], everything if repeated else eval_pool, ranks, s)
                weights = logged_weights(data["old"], p_log, log_queries, rng, Path(folder))
                hit_share[kind].append(float((weights > 0).mean()))
                drawn = np.bincount(rng.choice(n, size=eval_queries, p=p_eval), minlength=n).astype(np.float64)
                orders = {"random": random_order(n, seed), "sigma": sigma,
                          "usage": backfill_order("usage", n, seed, data["log_sigma2"], weights),
                          "usage_sigma": backfill_order("usage_sigma", n, seed, data["log_sigma2"], weights)}
                # a team's shadow index has no sigma: the usage order's ties go by position
                orders["shadow, random"] = orders["random"]
                orders["shadow, usage"] = backfill_order("usage", n, seed, None, weights)
                for name, order in orders.items():
                    per_query = shadow(order) if name in SHADOW else curve(order)
                    top1 = per_query @ drawn / drawn.sum()  # each point: the workload's mean top-1
                    results[kind][name].append({"seed": seed, "top1_auc": float(top1.mean()),
                                                "early": early_mean(alphas, top1), "top1_0": float(top1[0]),
                                                "top1_100": float(top1[-1]), "top1": top1.tolist()})
    return {"items": n, "log_queries": log_queries, "eval_queries": eval_queries, "results": results,
            "hit_share": hit_share}


def stat(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(run_result: dict) -> dict:
    """Per workload and order: mean ± std over seeds of top1_auc and the early mean, and each
    usage order's paired difference to sigma; whether it is within the noise between seeds."""
    out = {}
    for kind, by_order in run_result["results"].items():
        rows = {}
        for order, seeds in by_order.items():
            rows[order] = {key: stat([r[key] for r in seeds]) for key in ("top1_auc", "early", "top1_0", "top1_100")}
            rows[order]["minus_sigma"] = {key: stat([r[key] - q[key] for r, q in zip(seeds, by_order["sigma"])])
                                          for key in ("top1_auc", "early")}
        noise = max(rows["sigma"]["top1_auc"]["std"], *(rows[o]["top1_auc"]["std"] for o in ("usage", "usage_sigma")))
        for order in ("usage", "usage_sigma"):
            rows[order]["within_noise_of_sigma"] = rows[order]["minus_sigma"]["top1_auc"]["mean"] >= -noise
        out[kind] = {"orders": rows, "noise": noise, "hit_share": stat(run_result["hit_share"][kind])}
    return out


def pct(s: dict) -> str:
    return f"{100 * s['mean']:.2f} ± {100 * s['std']:.2f}"


def points(s: dict) -> str:
    return f"{100 * s['mean']:+.2f} ± {100 * s['std']:.2f}"


def table(summary: dict, n: int) -> list[str]:
    lines = ["| gallery | workload | order | top1_auc | top-1, 0-30% | top1_auc − sigma | 0-30% − sigma |",
             "|---|---|---|---|---|---|---|"]
    for kind, row in summary.items():
        for order, r in row["orders"].items():
            diff = r["minus_sigma"]
            versus = "| |" if order == "sigma" else f"{points(diff['top1_auc'])} | {points(diff['early'])} |"
            lines.append(f"| {n:,} | {kind} | {order} | {pct(r['top1_auc'])} | {pct(r['early'])} | {versus}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--zipf", type=float, default=1.1, help="the workloads' Zipf exponent s")
    parser.add_argument("--log-queries", type=float, default=0.5, help="logged queries, per gallery item")
    parser.add_argument("--eval-queries", type=int, default=10000, help="evaluation queries drawn per seed")
    parser.add_argument("--subset", type=int, nargs="*", default=[1000], help="also on random subsets of this size")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "usage_order")
    args = parser.parse_args()

    started = time.perf_counter()
    full = load_outputs(ROOT)
    report, lines = {"zipf": args.zipf, "seeds": args.seeds, "sizes": {}}, []
    for data in [full] + [subset(full, size, 0) for size in args.subset]:
        n = len(data["labels"])
        result = run(data, args.seeds, args.zipf, int(round(args.log_queries * n)), args.eval_queries, {},
                     args.workloads)
        summary = summarise(result)
        report["sizes"][n] = {"summary": summary, **result}
        lines += table(summary, n) if not lines else table(summary, n)[2:]
        print(f"{n} items done at {time.perf_counter() - started:.0f} s", flush=True)
    notes = []
    for n, size in report["sizes"].items():
        for kind, row in size["summary"].items():
            verdicts = [f"{o} {'within' if row['orders'][o]['within_noise_of_sigma'] else 'BELOW'}" for o in
                        ("usage", "usage_sigma")]
            ends, team = row["orders"]["sigma"], row["orders"]["shadow, usage"]
            notes.append(f"- {n:,} items, {kind}: top-1 {pct(ends['top1_0'])} at 0% (the shadow index: "
                         f"{pct(team['top1_0'])}), {pct(ends['top1_100'])} at 100%; "
                         f"items hit by the log {100 * row['hit_share']['mean']:.1f}%; seed noise (largest std of "
                         f"top1_auc) {100 * row['noise']:.2f} points; top1_auc vs sigma: {', '.join(verdicts)}")
    command = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python benchmarks/usage_order.py", *sys.argv[1:]])
    header = (f"Usage orders against sigma and random (`{command}`): Zipf s = {args.zipf}, {args.log_queries:g} logged queries "
              f"per item (top-10 hits each, old model), {args.eval_queries:,} evaluation queries per seed, seeds "
              f"{', '.join(map(str, args.seeds))}; top-1 in %, differences in points, mean ± std over seeds "
              f"({time.perf_counter() - started:.0f} s).")
    text = "\n".join([header, "", *lines, "", *notes]) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
