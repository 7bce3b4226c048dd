"""The budget advisor's prediction against the measured backfill curve (docs/results.md).

For each pipeline run given (its artifacts and data folders), the test split is the gallery:
the advisor sees the transformed features h(old) of every item, the backfill order of the
method (FastFill's sigma order, or random where the pipeline's check fell back to it) and an
evaluation sample of ``--sample`` labeled items with their new-model features, as an upgrade
does; the measured curve is the evaluation protocol's, over every item. Printed and written:
the largest gap between the two curves at every 10% (top-1 and mAP, points), and at the
recommended stop for ``--gain-below`` the items saved and the top-1 actually given up.

    python benchmarks/backfill_advisor.py --run artifacts:data \
        --run runs/sweep/n-300/seed-0/artifacts:runs/sweep/n-300/data --samples 5 --out reports/advisor
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastfill.components.evaluation.ordering import random_order, sigma_order  # noqa: E402
from fastfill.components.evaluation.retrieval import backfill_curve, per_query_curve  # noqa: E402
from fastfill.components.experiment.data import load_split  # noqa: E402
from fastfill.components.gallery.advice.advisor import advise, fractions, recommend  # noqa: E402
from fastfill.components.gallery.upgrade.planning import eval_sample  # noqa: E402


def _order(directory: Path, n: int, seed: int) -> tuple[np.ndarray, str]:
    check = directory / "check.json"
    fell_back = check.is_file() and json.loads(check.read_text()).get("fallback_order", {}).get("order") == "random"
    sigma = directory / "log_sigma2.npy"
    if sigma.is_file() and not fell_back:
        return sigma_order(np.load(sigma)), "sigma"
    return random_order(n, seed), "random"


def measure_run(artifacts: Path, data: Path, method: str, sample: int, samples: int, gain_below: float,
                part_size: int = 1000) -> dict:
    labels = load_split(data / "splits", "test").labels
    new = np.load(artifacts / "features" / "new" / "test.npy")
    directory = artifacts / "align" / method
    transformed = np.load(directory / "gallery_old.npy")
    n = len(labels)
    order, kind = _order(directory, n, 0)
    steps = len(fractions()) - 2
    measured = backfill_curve(new, new, transformed, labels, order, num_intermediate=steps)
    # every query's own top-1 along the real curve: the mean over a sample's queries is the best
    # any prediction from that sample can do (the hidden new features of the whole gallery used)
    per_query_top1, _ = per_query_curve(new, new, transformed, labels, order, num_intermediate=steps)
    every10 = np.arange(0, len(measured.alphas), 2)
    rows = []
    for s in range(samples):
        positions = eval_sample(labels, sample, s)
        started = time.perf_counter()
        parts = ((p, transformed[p:p + part_size]) for p in range(0, n, part_size))
        predicted = advise(parts, order, positions, new[positions], labels, gain_below=gain_below)
        seconds = time.perf_counter() - started
        top1, mAP = np.asarray(predicted["top1"]), np.asarray(predicted["map"])
        stop = predicted["recommendation"]
        k = int(round(stop["fraction"] / 0.05))
        # the stop the measured curve itself recommends, for comparison
        truth = recommend({**predicted, "top1": measured.top1.tolist(), "map": measured.map.tolist()}, gain_below)
        floor = per_query_top1[:, positions].mean(axis=1)
        rows.append({
            "sample_seed": s, "seconds": seconds,
            "top1_floor_gap": float(100 * np.abs(floor - measured.top1)[every10].max()),
            "top1_method_gap": float(100 * np.abs(top1 - floor)[every10].max()),
            "top1_max_gap": float(100 * np.abs(top1 - measured.top1)[every10].max()),
            "map_max_gap": float(100 * np.abs(mAP - measured.map)[every10].max()),
            "top1_within_1": float(np.mean(100 * np.abs(top1 - measured.top1)[every10] <= 1)),
            "map_within_1": float(np.mean(100 * np.abs(mAP - measured.map)[every10] <= 1)),
            "top1_in_band": float(np.mean(np.abs(top1 - measured.top1)[every10]
                                          <= 2 * np.asarray(predicted["top1_se"])[every10])),
            "stop": stop["fraction"], "items_saved": stop["items_saved"],
            "given_up_predicted": 100 * stop["top1_given_up"],
            "given_up_measured": float(100 * (measured.top1[-1] - measured.top1[k])),
            "stop_from_measured_curve": truth["fraction"],
            "predicted_top1": (100 * top1[every10]).round(2).tolist(),
        })
    return {"artifacts": str(artifacts), "method": method, "order": kind, "items": n, "sample": sample,
            "measured_top1": (100 * measured.top1[every10]).round(2).tolist(),
            "measured_map": (100 * measured.map[every10]).round(2).tolist(), "samples": rows}


def _mean(rows, key):
    return float(np.mean([r[key] for r in rows]))


def markdown(results: list[dict], gain_below: float) -> str:
    lines = ["# The budget advisor: predicted against measured backfill curves", "",
             "Each row is one pipeline run (the test split as the gallery); the advisor is given h(old) of every item, "
             "the method's backfill order and a random labeled sample with its new-model features, and predicts "
             "top-1 and mAP every 5%. Gaps are in points, at every 10% (11 points), averaged over the samples "
             f"drawn. The stop is the recommended one for a gain below {gain_below:g} top-1 points per 5%.", "",
             "The sampling floor is the largest gap between the measured curve and the same curve averaged over the "
             "sample's queries only (what a perfect prediction from that sample would give); the method's gap is the "
             "prediction's largest gap to that sample-query curve.", "",
             "| run | order | sample | top-1 max gap | top-1 within 1 | sampling floor / method | mAP max gap | mAP within 1 "
             "| top-1 within 2 s.e. | stop (from measured curve) | items saved | top-1 given up: predicted / measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows = r["samples"]
        stops = ", ".join(f"{100 * x['stop']:.0f}%" for x in rows)
        lines.append(
            f"| {r['label']} | {r['order']} | {r['sample']} of {r['items']} | {_mean(rows, 'top1_max_gap'):.2f} "
            f"(worst {max(x['top1_max_gap'] for x in rows):.2f}) | {100 * _mean(rows, 'top1_within_1'):.0f}% | "
            f"{_mean(rows, 'top1_floor_gap'):.2f} / {_mean(rows, 'top1_method_gap'):.2f} | "
            f"{_mean(rows, 'map_max_gap'):.2f} (worst {max(x['map_max_gap'] for x in rows):.2f}) | "
            f"{100 * _mean(rows, 'map_within_1'):.0f}% | {100 * _mean(rows, 'top1_in_band'):.0f}% | {stops} "
            f"({100 * rows[0]['stop_from_measured_curve']:.0f}%) | {_mean(rows, 'items_saved'):.0f} | "
            f"{_mean(rows, 'given_up_predicted'):.2f} / {_mean(rows, 'given_up_measured'):.2f} |")
    lines += ["", "Measured and predicted top-1 at 0, 10, ..., 100% (first sample):", ""]
    for r in results:
        lines.append(f"- {r['label']}: measured {r['measured_top1']}; predicted {r['samples'][0]['predicted_top1']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", action="append", required=True,
                        help="ARTIFACTS:DATA[:LABEL], a pipeline run's artifacts folder and its data folder")
    parser.add_argument("--method", default="fastfill")
    parser.add_argument("--sample", type=int, default=2000, help="the evaluation sample (gallery.upgrade.eval_queries)")
    parser.add_argument("--samples", type=int, default=5, help="samples drawn per run")
    parser.add_argument("--gain-below", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    results = []
    for spec in args.run:
        artifacts, data, *label = spec.split(":")
        result = measure_run(Path(artifacts), Path(data), args.method, args.sample, args.samples, args.gain_below)
        result["label"] = label[0] if label else artifacts
        rows = result["samples"]
        print(f"{result['label']}: {result['order']} order, top-1 max gap {_mean(rows, 'top1_max_gap'):.2f} "
              f"(worst {max(x['top1_max_gap'] for x in rows):.2f}), mAP max gap {_mean(rows, 'map_max_gap'):.2f}, "
              f"top-1 within 1 point at {100 * _mean(rows, 'top1_within_1'):.0f}% of the points; stop at "
              f"{[x['stop'] for x in rows]}, {_mean(rows, 'seconds'):.1f} s per prediction", flush=True)
        results.append(result)
    text = markdown(results, args.gain_below)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"gain_below": args.gain_below, "runs": results}, indent=2))
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
