"""The promotion gate: is the challenger, along its backfill, better than the champion?

Measured on the upgrade's evaluation sample S (labeled items that are both queries and gallery,
each query removed from its own gallery):

- the champion: the gallery's current model, queries and gallery on its stored features;
- the challenger: new-model queries against the gallery as it is after backfilling the first
  fraction alpha of the upgrade's order (new features there, transformed old ones elsewhere),
  at alpha = i / (B + 1), i = 0 .. B + 1, as in the evaluation protocol.

Gates (PromotionConfig): the challenger's mean top-1 along the curve minus the champion's top-1
(``top1_auc_gain``), the mean negative-flip rate at top-1 against the champion along the curve
(``nfr1_mean``: champion right, challenger wrong), absolute and relative to the flips of errors
independent of the champion's (``relative_nfr``), and the smallest backfilled fraction at which
the challenger's top-1 exceeds the champion's (``fraction_to_gain``; None = never).
"""

from __future__ import annotations

import numpy as np

from fastfill.components.evaluation import curve_alphas, pairwise_distances
from fastfill.components.platform.config import PromotionConfig


def top1_correct(queries: np.ndarray, gallery: np.ndarray, labels: np.ndarray, distance: str) -> np.ndarray:
    """Per query: is its nearest gallery item (itself excluded; query i is gallery item i) of its label?"""
    distances = pairwise_distances(queries, gallery, distance)
    np.fill_diagonal(distances, np.inf)
    return labels[np.argmin(distances, axis=1)] == labels


def measure_gate(champion: np.ndarray, queries: np.ndarray, new: np.ndarray, transformed: np.ndarray,
                 labels: np.ndarray, local_order: np.ndarray, *, distance: str = "l2", curve_points: int = 20) -> dict:
    """``champion``: the champion's features of S; ``queries``/``new``: the challenger's;
    ``transformed``: the old side of S in the challenger's space; ``local_order``: the backfill
    order restricted to S (indices into S)."""
    n = len(labels)
    if not (len(champion) == len(queries) == len(new) == len(transformed) == len(local_order) == n) or n < 2:
        raise ValueError(f"the gate needs the same >= 2 items in every input, got champion {len(champion)}, queries "
                         f"{len(queries)}, new {len(new)}, transformed {len(transformed)}, labels {n}, "
                         f"order {len(local_order)}")
    right = top1_correct(champion, champion, labels, distance)
    alphas = curve_alphas(curve_points)
    top1, nfr1 = [], []
    for alpha in alphas:
        gallery = transformed.copy()
        backfilled = local_order[: int(np.floor(alpha * n + 1e-9))]
        gallery[backfilled] = new[backfilled]
        correct = top1_correct(queries, gallery, labels, distance)
        top1.append(float(correct.mean()))
        nfr1.append(float((right & ~correct).sum() / max(1, right.sum())))
    champion_top1 = float(right.mean())
    beyond = [float(a) for a, t in zip(alphas, top1) if t > champion_top1]
    return {"queries": n, "champion_top1": champion_top1, "alpha": [float(a) for a in alphas], "top1": top1,
            "nfr1": nfr1, "top1_auc": float(np.mean(top1)), "top1_auc_gain": float(np.mean(top1)) - champion_top1,
            "nfr1_mean": float(np.mean(nfr1)), "nfr1_end": nfr1[-1],
            "fraction_to_gain": beyond[0] if beyond else None}


def relative_nfr(numbers: dict) -> float | None:
    """The negative flips as a share of those a challenger of the same top-1 would make if its
    errors ignored which queries the champion gets right: ``nfr1_mean / (1 - top1_auc)``, both
    along the backfill (0 where the challenger is never wrong; None without the numbers). About 1
    for errors independent of the champion's; a real upgrade keeps the champion's right answers
    better than that (docs/upgrade.md, "The promotion gate")."""
    if "top1_auc" not in numbers or "nfr1_mean" not in numbers:
        return None
    wrong = 1.0 - numbers["top1_auc"]
    return float(numbers["nfr1_mean"] / wrong) if wrong > 1e-12 else 0.0


def decide(numbers: dict, config: PromotionConfig) -> tuple[bool, list[str]]:
    """Passed, and the reason for each gate that failed."""
    reasons = []
    points = f" over {len(numbers['alpha'])} points" if "alpha" in numbers else ""  # the curve the means are over
    if numbers["top1_auc_gain"] < config.min_top1_auc_gain:
        reasons.append(f"top-1 gain along the backfill {100 * numbers['top1_auc_gain']:+.2f} points is below the "
                       f"minimum {100 * config.min_top1_auc_gain:+.2f}")
    if numbers["nfr1_mean"] > config.max_nfr1:
        end = f"; at the end, all backfilled: {100 * numbers['nfr1_end']:.2f}%" if "nfr1_end" in numbers else ""
        reasons.append(f"negative flip rate at top-1 {100 * numbers['nfr1_mean']:.2f}% is above the maximum "
                       f"{100 * config.max_nfr1:.2f}% (promotion.max_nfr1; the mean along the backfill{points} from 0% "
                       f"to 100% of the champion's right answers the challenger gets wrong{end})")
    relative = relative_nfr(numbers)
    if relative is not None and relative > config.max_relative_nfr1:
        reasons.append(f"negative flip rate at top-1 {100 * numbers['nfr1_mean']:.2f}% is {relative:.2f} of the "
                       f"{100 * (1 - numbers['top1_auc']):.2f}% that a challenger of its top-1 would flip if its errors "
                       f"ignored the champion's right answers, above the maximum {config.max_relative_nfr1:.2f} "
                       f"(promotion.max_relative_nfr1; both the mean along the backfill{points})")
    reached = numbers["fraction_to_gain"]
    if reached is None:
        reasons.append("top-1 never exceeds the champion's along the backfill")
    elif reached > config.max_fraction_to_gain:
        reasons.append(f"top-1 exceeds the champion's only at {100 * reached:.0f}% backfilled, later than the "
                       f"allowed {100 * config.max_fraction_to_gain:.0f}%")
    return not reasons, reasons


def decision_tags(passed: bool, reasons: list[str], numbers: dict, champion_version: str, upgrade_id: str) -> dict:
    """The decision and its numbers as MLflow tags (model version and run)."""
    reached, relative = numbers["fraction_to_gain"], relative_nfr(numbers)
    return {
        "promotion": "passed" if passed else "rejected",
        "promotion.reason": "all gates passed" if passed else "; ".join(reasons),
        "promotion.upgrade": upgrade_id,
        "promotion.champion_version": str(champion_version),
        "promotion.champion_top1": f"{numbers['champion_top1']:.6f}",
        "promotion.top1_auc": f"{numbers['top1_auc']:.6f}",
        "promotion.top1_auc_gain": f"{numbers['top1_auc_gain']:.6f}",
        "promotion.nfr1_mean": f"{numbers['nfr1_mean']:.6f}",
        "promotion.nfr1_relative": "" if relative is None else f"{relative:.6f}",
        "promotion.fraction_to_gain": "never" if reached is None else f"{reached:.6f}",
        "promotion.queries": str(numbers["queries"]),
    }


def gate_message(numbers: dict, passed: bool, reasons: list[str], new_uri: str, champion_uri: str) -> str:
    """One line on the gate's decision, for the log."""
    reached, relative = numbers["fraction_to_gain"], relative_nfr(numbers)
    return (f"promotion gate for {new_uri} against {champion_uri}: top-1 {100 * numbers['champion_top1']:.2f}% -> "
            f"mean {100 * numbers['top1_auc']:.2f}% along the backfill ({100 * numbers['top1_auc_gain']:+.2f} points), NFR@1 "
            f"{100 * numbers['nfr1_mean']:.2f}% mean along the backfill"
            + (f" ({100 * numbers['nfr1_end']:.2f}% at the end)" if "nfr1_end" in numbers else "")
            + ("" if relative is None else f", {relative:.2f} of independent errors' flips") + ", "
            f"gain reached at "
            f"{'never' if reached is None else f'{100 * reached:.0f}%'}: {'PASSED' if passed else 'REJECTED'}"
            + ("" if passed else f" ({'; '.join(reasons)})"))
