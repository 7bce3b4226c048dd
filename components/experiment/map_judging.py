"""How the map check judges maps on the held-out pairs: each map's outputs there, the simulated
backfill curve's numbers (per query, with a paired bootstrap of the queries), the rule a map
must meet against the l2-only map (``judge``) and a fallback map's sigma order against a random
one (``judge_order``), and what counts as a map that diverged (outputs that are not finite).
components.experiment.map_check applies them to trained maps and decides which map is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fastfill.components.evaluation import backfill_curve, per_query_curve
from fastfill.components.evaluation.ordering import random_order, sigma_order
from fastfill.components.platform.config import AlignConfig

POLICIES = ("fail", "fallback", "warn")
CHECK_POINTS = 10  # intermediate points of the simulated curve (12 in all)


class MapCheckError(RuntimeError):
    """A map failed its check under ``check: fail``; the message names both numbers."""


@dataclass(frozen=True)
class SideOutputs:
    """One map on the held-out pairs: the gallery's old side, the new side (queries and
    backfilled items) and, with an uncertainty head, log sigma^2."""

    gallery_old: np.ndarray
    new_side: np.ndarray
    log_sigma2: np.ndarray | None = None


def _order(side: SideOutputs, order_name: str, seed: int) -> np.ndarray:

    if order_name != "sigma":
        return random_order(len(side.new_side), seed)
    if side.log_sigma2 is None:
        raise ValueError("the sigma order needs the map's log sigma^2, and this map has no uncertainty head")
    return sigma_order(side.log_sigma2)


def curve_numbers(side: SideOutputs, labels: np.ndarray, order_name: str, seed: int, distance: str = "l2") -> dict:
    """Top-1 and mAP at 0% and their means over the 12-point simulated curve on held-out pairs
    (queries and backfilled items: the new side; the rest of the gallery: the old side)."""

    curve = backfill_curve(side.new_side, side.new_side, side.gallery_old, labels, _order(side, order_name, seed),
                           distance=distance, num_intermediate=CHECK_POINTS)
    return {"order": order_name, "top1_0": float(curve.top1[0]), "map_0": float(curve.map[0]),
            "top1_auc": float(np.mean(curve.top1)), "map_auc": float(np.mean(curve.map))}


def _per_query(side: SideOutputs, labels: np.ndarray, order_name: str, seed: int, distance: str
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top-1 hits, AP) per curve point and query, and which queries have a positive."""

    labels = np.asarray(labels)
    top1, precision = per_query_curve(side.new_side, side.new_side, side.gallery_old, labels,
                                      _order(side, order_name, seed), distance=distance,
                                      num_intermediate=CHECK_POINTS)
    _, inverse, class_sizes = np.unique(labels, return_inverse=True, return_counts=True)
    return top1, precision, class_sizes[inverse] > 1


def _measured(side: SideOutputs, order_name: str, labels: np.ndarray, seed: int, distance: str
              ) -> tuple[dict, tuple[np.ndarray, np.ndarray]]:
    """``curve_numbers`` and each query's top-1 and average precision averaged over the 12 curve
    points (top1 (n,), AP (m,) for the m queries with a positive; their means are top1_auc and
    map_auc), from one ranking of the held-out pairs."""
    top1, precision, has_positive = _per_query(side, labels, order_name, seed, distance)
    hits, ap = top1.mean(axis=0), precision.mean(axis=0)[has_positive]
    map_0 = float(precision[0][has_positive].mean()) if has_positive.any() else 0.0
    numbers = {"order": order_name, "top1_0": float(top1[0].mean()), "map_0": map_0,
               "top1_auc": float(hits.mean()), "map_auc": float(ap.mean()) if len(ap) else 0.0}
    return numbers, (hits, ap)


def _bootstrap_support(candidate: np.ndarray, reference: np.ndarray, tolerance: float, seed: int,
                       resamples: int = 2000) -> float:
    """The share of paired bootstrap resamples of the queries in which the candidate's mean is at
    least the reference's minus ``tolerance``."""
    if not len(candidate):
        return 1.0
    difference = candidate - reference
    index = np.random.default_rng([seed, 0xB007]).integers(0, len(difference), (resamples, len(difference)))
    return float(np.mean(difference[index].mean(axis=1) >= -tolerance - 1e-12))


def _contest(config: AlignConfig, challenger: tuple[SideOutputs, str], incumbent: tuple[SideOutputs, str],
             labels: np.ndarray, distance: str) -> tuple[dict, dict, list[str]]:
    """The check's rule: the challenger (a map and its order) must be at least the incumbent minus
    ``check_tolerance`` in top1_auc and map_auc, on the mean and in ``check_confidence`` of paired
    bootstrap resamples of the held-out queries. Returns both sides' numbers (the challenger's
    with its ``*_support``) and the measures where it falls short."""
    numbers, mine = _measured(*challenger, labels, config.seed, distance)
    baseline, theirs = _measured(*incumbent, labels, config.seed, distance)
    for key, a, b in (("top1_auc", mine[0], theirs[0]), ("map_auc", mine[1], theirs[1])):
        numbers[f"{key}_support"] = _bootstrap_support(a, b, config.check_tolerance, config.seed)
    short = [key for key in ("top1_auc", "map_auc")
             if numbers[key] < baseline[key] - config.check_tolerance
             or numbers[f"{key}_support"] < config.check_confidence]
    return numbers, baseline, short


@dataclass
class MapCheck:
    """The outcome: ``passed``, and ``action``: ``kept`` (passed, or warn), ``fallback`` (the l2
    map replaces it) or ``failed`` (the stage stops)."""

    method: str
    policy: str
    passed: bool
    action: str
    candidate: dict
    reference: dict
    tolerance: float
    message: str
    confidence: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"method": self.method, "policy": self.policy, "passed": self.passed, "action": self.action,
                "candidate": self.candidate, "reference": self.reference, "tolerance": self.tolerance,
                "confidence": self.confidence,
                "message": self.message, **self.extra}


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


# A feature row whose squared norm reaches this overflows the float32 distances retrieval ranks by.
_UNRANKABLE = float(np.finfo(np.float32).max) / 4


def non_finite_rows(values: np.ndarray) -> int:
    """How many rows of features (n, d), or values (n,), are not finite in float32; for
    features, also those so large that their distances would overflow (retrieval refuses both)."""
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.asarray(values, dtype=np.float32)  # beyond float32's range: inf
        if values.ndim == 1:
            return int((~np.isfinite(values)).sum())
        return int((~(np.einsum("ij,ij->i", values, values) < _UNRANKABLE)).sum())  # NaN compares False


def non_finite_outputs(side: SideOutputs) -> list[str]:
    """Which of a map's outputs on the held-out pairs are not finite, e.g. ["transformed
    features in 40 of 40 rows"]; empty for a map that did not diverge."""
    names = {"gallery_old": "transformed features", "new_side": "new-side features", "log_sigma2": "log sigma^2"}
    found = []
    for name, what in names.items():
        values = getattr(side, name)
        bad = 0 if values is None else non_finite_rows(values)
        if bad:
            found.append(f"{what} in {bad} of {len(values)} rows")
    return found


def _diverged(method: str, config: AlignConfig, candidate: SideOutputs, reference: SideOutputs, labels: np.ndarray,
              bad: list[str], distance: str) -> MapCheck:
    """The check of a map whose held-out outputs are not finite: a failed map that no policy
    keeps (``fail`` raises, ``fallback`` and ``warn`` use the l2-only map)."""
    reason = (f"non-finite outputs: {method}'s outputs on the {len(labels)} held-out pairs are not finite "
              f"({'; '.join(bad)}): the map diverged and is never used")
    if config.check == "fail":
        raise MapCheckError(f"map check failed: {reason}. What to try: a lower align.{method}.lr, "
                            f"align.{method}.uncertainty_weighting: normalized, or align.{method}.check: fallback "
                            "to use the l2 map")
    if non_finite_outputs(reference):
        raise MapCheckError(f"map check failed: {reason}, and the l2-only map that would replace it diverged too "
                            f"({'; '.join(non_finite_outputs(reference))}). What to try: a lower align.{method}.lr")
    baseline = curve_numbers(reference, labels, "random", config.seed, distance)
    missing = dict.fromkeys(("top1_0", "map_0", "top1_auc", "map_auc"), float("nan"))
    order = "sigma" if candidate.log_sigma2 is not None else "random"
    return MapCheck(method, config.check, False, "fallback", {"order": order, **missing}, baseline,
                    config.check_tolerance, confidence=config.check_confidence, extra={"non_finite": bad},
                    message=f"{reason}; the stage uses the l2-only map instead"
                    + (" (check: warn cannot keep a map that diverged)" if config.check == "warn" else ""))


def judge(method: str, config: AlignConfig, candidate: SideOutputs, reference: SideOutputs, labels: np.ndarray,
          *, distance: str = "l2") -> MapCheck:
    """Measure both maps on the held-out pairs and apply ``config.check``. Raises MapCheckError
    under ``fail`` when the map trails the l2-only map by more than ``config.check_tolerance``
    in top1_auc or map_auc, or when its outputs are not finite (then ``fallback`` and ``warn``
    both replace it by the l2-only map)."""
    if config.check not in POLICIES:
        raise ValueError(f"align.{method}.check must be one of {POLICIES}, got {config.check!r}")
    bad = non_finite_outputs(candidate)
    if bad:
        return _diverged(method, config, candidate, reference, labels, bad, distance)
    order = "sigma" if candidate.log_sigma2 is not None else "random"
    if non_finite_outputs(reference):  # nothing to measure against, nor to fall back on
        reason = (f"the l2-only map's outputs on the {len(labels)} held-out pairs are not finite "
                  f"({'; '.join(non_finite_outputs(reference))}), so {method} cannot be checked")
        if config.check == "fail":
            raise MapCheckError(f"map check failed: {reason}. What to try: a lower align.{method}.lr")
        missing = dict.fromkeys(("top1_0", "map_0", "top1_auc", "map_auc"), float("nan"))
        return MapCheck(method, config.check, False, "kept", curve_numbers(candidate, labels, order, config.seed,
                                                                           distance), {"order": "random", **missing},
                        config.check_tolerance, f"{reason}; the stage keeps the map", config.check_confidence)
    numbers, baseline, short = _contest(config, (candidate, order), (reference, "random"), labels, distance)
    tolerance, confidence = config.check_tolerance, config.check_confidence
    summary = (f"{method} ({order} order) on {len(labels)} held-out pairs: top1_auc {_pct(numbers['top1_auc'])}, "
               f"map_auc {_pct(numbers['map_auc'])}, top-1 at 0% {_pct(numbers['top1_0'])}; the l2-only map "
               f"(random order): top1_auc {_pct(baseline['top1_auc'])}, map_auc {_pct(baseline['map_auc'])}, "
               f"top-1 at 0% {_pct(baseline['top1_0'])}; the map is at least as good in "
               f"{_pct(numbers['top1_auc_support'])}% (top1_auc) and {_pct(numbers['map_auc_support'])}% (map_auc) of "
               f"bootstrap resamples of the queries, {_pct(confidence)}% required")
    if not short:
        return MapCheck(method, config.check, True, "kept", numbers, baseline, tolerance, f"passed: {summary}",
                        confidence)
    advice = (f"with few held-out pairs, a larger align.{method}.validation_fraction or a lower "
              f"align.{method}.check_confidence; try a larger align.{method}.min_steps, "
              f"align.{method}.uncertainty_weighting: normalized, more training "
              f"pairs, or align.{method}.check: fallback to use the l2 map")
    worse = " and ".join(short)
    if config.check == "fail":
        raise MapCheckError(f"map check failed: {method} is not shown to match the l2-only map in {worse} "
                            f"(tolerance {tolerance}, confidence {confidence}). {summary}. What to try: {advice}")
    action = "fallback" if config.check == "fallback" else "kept"
    verb = "uses the l2-only map instead" if action == "fallback" else "keeps the map (check: warn)"
    return MapCheck(method, config.check, False, action, numbers, baseline, tolerance,
                    confidence=confidence,
                    message=f"{method} is not shown to match the l2-only map in {worse}; the stage {verb}. {summary}")


def judge_order(method: str, config: AlignConfig, side: SideOutputs, labels: np.ndarray, *,
                distance: str = "l2") -> dict:
    """Whether a fallback map's sigma order (its fitted head) is shown to be at least as good as a
    random order of the same map on the held-out pairs, by the map check's own rule. Returns
    ``order`` (``sigma``, or ``random`` when it is not), both orders' numbers and a message."""
    if non_finite_outputs(side):  # only its fitted head can be: the l2-only map's were checked
        random = curve_numbers(side, labels, "random", config.seed, distance)
        return {"method": method, "order": "random", "random": random,
                "sigma": {"order": "sigma", **dict.fromkeys(("top1_0", "map_0", "top1_auc", "map_auc"), float("nan"))},
                "message": f"the head fitted on the l2-only map gives non-finite outputs on the held-out pairs "
                           f"({'; '.join(non_finite_outputs(side))}), so the fallback map is backfilled in random "
                           "order (FCT)"}
    sigma, random, short = _contest(config, (side, "sigma"), (side, "random"), labels, distance)
    order = "random" if short else "sigma"
    summary = (f"on {len(labels)} held-out pairs, the sigma order of the head fitted on the l2-only map: top1_auc "
               f"{_pct(sigma['top1_auc'])}, map_auc {_pct(sigma['map_auc'])}; a random order: top1_auc "
               f"{_pct(random['top1_auc'])}, map_auc {_pct(random['map_auc'])}; at least as good in "
               f"{_pct(sigma['top1_auc_support'])}% / {_pct(sigma['map_auc_support'])}% of bootstrap resamples, "
               f"{_pct(config.check_confidence)}% required")
    verdict = ("the fallback map keeps its sigma order" if order == "sigma" else
               f"the sigma order is not shown to help in {' and '.join(short)}, so the fallback map is backfilled "
               "in random order (FCT)")
    return {"method": method, "order": order, "sigma": sigma, "random": random, "message": f"{verdict}: {summary}"}
