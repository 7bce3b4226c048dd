"""Where FastFill's sigma order does not beat a random one on a team's pair: which part of its
premise fails? The order rests on two claims: (1) psi ranks the items by how far h(old) is from
their new features (its training target), and (2) backfilling the items with the largest such
error first raises retrieval faster than a random order does. This measures both, per pair, with
the upgrade's map (``AlignConfig.for_upgrade``, the disc term off, as benchmarks/team_map_conditioning
trains it) on the items outside the map sample:

- claim (1): Kendall's tau between psi's log sigma^2 and the items' true l2 error
  ||phi_new - h(phi_old)||^2 (1 = the same ranking);
- claim (2): top1_auc / map_auc of the backfill in the *oracle* order (descending true l2 error,
  which needs the new features, so analysis only) against the random order: if the oracle does
  not beat random, no head can, and the failure is the premise, not psi;
- the sigma order's AUCs beside them.

    .venv/bin/python benchmarks/team_sigma_premise.py --seeds 0 1 2

Writes reports/team_sigma_premise.{md,json}. Pairs and features as in
benchmarks/team_map_conditioning.py (``--cache``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disc_term_study import ROOT, study_configs  # noqa: E402
from benchmarks.team_advisor_map import team_features  # noqa: E402
from benchmarks.team_map_conditioning import wide_features  # noqa: E402


def premise(feats: dict, map_sample: int, seed: int, fastfill) -> dict:
    import torch

    from fastfill.components.evaluation.ordering import kendall_tau, oracle_order, random_order, sigma_order
    from fastfill.components.evaluation.retrieval import backfill_curve
    from fastfill.components.experiment.inference import apply_alignment
    from fastfill.components.experiment.map_training import train_alignment
    from fastfill.components.gallery.upgrade.pairs import sample_positions
    from fastfill.components.gallery.upgrade.pseudo_classes import cluster_classes

    old, new, labels = feats["old"], feats["new"], feats["labels"]
    sample = sample_positions(len(labels), min(map_sample, len(labels) - 200), seed)
    rest = np.setdiff1d(np.arange(len(labels)), sample)
    rows, head, _ = cluster_classes(new[sample], 50, seed)
    config = fastfill.model_copy(update={"seed": seed}).for_upgrade().model_copy(update={"disc": False})
    cpu = torch.device("cpu")
    h, _ = train_alignment(config, old[sample], new[sample], rows, head, device=cpu, log=lambda _: None,
                           method="fastfill")
    transformed, sigma = apply_alignment(h.eval(), old[rest], device=cpu)
    error = np.square(new[rest] - transformed).sum(axis=1)
    orders = {"random": random_order(len(rest), seed), "sigma": sigma_order(sigma), "oracle": oracle_order(error)}
    out = {"tau_sigma_error": round(float(kendall_tau(sigma, error)), 3)}
    for name, order in orders.items():
        curve = backfill_curve(new[rest], new[rest], transformed, labels[rest], order)
        out[name] = {"top1_auc": round(100 * curve.top1_auc, 2), "map_auc": round(100 * curve.map_auc, 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="fashion-1024,bars-1024,wide,fashion,bars")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--map-sample", type=int, default=1000)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fastfill-team-features"))
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "team_sigma_premise")
    args = parser.parse_args(argv)
    fastfill, _ = study_configs()
    started, runs = time.perf_counter(), []
    for pair in args.pairs.split(","):
        feats = (wide_features(2000, 0) if pair == "wide" else
                 team_features(pair.removesuffix("-1024"), 4000, 2000, 2, 0, args.cache,
                               penultimate=pair.endswith("-1024")))
        for seed in args.seeds:
            result = {"pair": pair, "seed": seed, **premise(feats, args.map_sample, seed, fastfill)}
            runs.append(result)
            print(json.dumps(result), flush=True)
            write_report(args, runs, started, argv)  # after every run: a long study stopped early keeps what it measured
    print(f"wrote {args.out}.md and {args.out}.json")
    return 0


def write_report(args, runs: list[dict], started: float, argv: list[str] | None) -> None:
    command = " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": command, "seconds": round(time.perf_counter() - started, 1), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Where the sigma order does not beat random: psi's ranking, or the premise?", "",
             f"`.venv/bin/python benchmarks/team_sigma_premise.py {command}` ({report['seconds']:.0f} s, 2 CPU "
             "cores). The upgrade's map on each pair (disc term off), measured on the items outside the map sample. "
             "tau: Kendall's tau between psi's log sigma^2 and the true l2 error; AUCs (top1_auc / map_auc, %) of the "
             "backfill in random, sigma and oracle (true l2 error, descending) order.", "",
             "| pair | seed | tau | random | sigma | oracle |", "|---|---|---|---|---|---|"]
    for run in runs:
        cells = [f"{run[o]['top1_auc']:.2f} / {run[o]['map_auc']:.2f}" for o in ("random", "sigma", "oracle")]
        lines.append(f"| {run['pair']} | {run['seed']} | {run['tau_sigma_error']:.3f} | " + " | ".join(cells) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
