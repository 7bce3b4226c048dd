"""The map check: before a trained map is used, it must retrieve at least as well as the plain
l2-only map trained on the same pairs, measured on the held-out pairs at 0% backfill and along a
simulated backfill curve (the map with its own order, sigma when it has an uncertainty head;
the l2 map with a random order, as FCT).

The policy is configuration (``align.<method>.check``): ``fail`` stops with both numbers and what
to try, ``fallback`` uses the l2 map instead and records why, ``warn`` keeps the map and records
the warning. When the method orders by sigma, the fallback map gets an uncertainty head fitted on
it, and keeps the sigma order only where the same rule shows it at least as good as a random
order; otherwise it is backfilled in random order, exactly as FCT.

A map whose outputs on the held-out pairs are not finite (it diverged) is never used: ``fail``
stops, ``fallback`` and ``warn`` both use the l2 map, and the record (its message, tags and
metrics) says which outputs were not finite.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from components.platform.config import AlignConfig
from components.experiment.map_validation import held_out  # noqa: F401 - part of the check's interface

POLICIES = ("fail", "fallback", "warn")
CHECK_POINTS = 10  # intermediate points of the simulated curve (12 in all)

# The settings the l2-only reference shares with the map it checks: same pairs, same split,
# same schedule, same seed. Everything else is FCT's (l2 only, an MLP, no uncertainty head).
_SHARED = ("l2_reduction", "epochs", "min_steps", "warmup_epochs", "batch_size", "lr", "weight_decay",
           "validation_fraction", "validation_items", "seed", "precision")


class MapCheckError(RuntimeError):
    """A map failed its check under ``check: fail``; the message names both numbers."""


def reference_config(config: AlignConfig) -> AlignConfig:
    """The l2-only map a map is checked against: FCT with the map's schedule and ``hidden``
    widths (for an RBT or unified map, ``hidden`` gives only the reference's widths)."""
    shared = {name: getattr(config, name) for name in _SHARED}
    return AlignConfig(l2=True, disc=False, uncertainty=False, architecture="mlp", hidden=list(config.hidden), **shared)


def is_reference(config: AlignConfig) -> bool:
    """The map is an l2-only MLP: it is its own reference and needs no check."""
    return config.l2 and not config.disc and not config.uncertainty and config.architecture == "mlp"


@dataclass(frozen=True)
class SideOutputs:
    """One map on the held-out pairs: the gallery's old side, the new side (queries and
    backfilled items) and, with an uncertainty head, log sigma^2."""

    gallery_old: np.ndarray
    new_side: np.ndarray
    log_sigma2: np.ndarray | None = None


def _order(side: SideOutputs, order_name: str, seed: int) -> np.ndarray:
    from components.evaluation.ordering import random_order, sigma_order

    return sigma_order(side.log_sigma2) if order_name == "sigma" else random_order(len(side.new_side), seed)


def curve_numbers(side: SideOutputs, labels: np.ndarray, order_name: str, seed: int, distance: str = "l2") -> dict:
    """Top-1 and mAP at 0% and their means over the 12-point simulated curve on held-out pairs
    (queries and backfilled items: the new side; the rest of the gallery: the old side)."""
    from components.evaluation import backfill_curve

    curve = backfill_curve(side.new_side, side.new_side, side.gallery_old, labels, _order(side, order_name, seed),
                           distance=distance, num_intermediate=CHECK_POINTS)
    return {"order": order_name, "top1_0": float(curve.top1[0]), "map_0": float(curve.map[0]),
            "top1_auc": float(np.mean(curve.top1)), "map_auc": float(np.mean(curve.map))}


def _per_query(side: SideOutputs, labels: np.ndarray, order_name: str, seed: int, distance: str
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top-1 hits, AP) per curve point and query, and which queries have a positive."""
    from components.evaluation import per_query_curve

    labels = np.asarray(labels)
    top1, precision = per_query_curve(side.new_side, side.new_side, side.gallery_old, labels,
                                      _order(side, order_name, seed), distance=distance,
                                      num_intermediate=CHECK_POINTS)
    _, inverse, class_sizes = np.unique(labels, return_inverse=True, return_counts=True)
    return top1, precision, class_sizes[inverse] > 1


def per_query_scores(side: SideOutputs, labels: np.ndarray, order_name: str, seed: int, distance: str = "l2"
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Each query's top-1 and average precision, averaged over the 12 curve points: (top1 (n,),
    AP (m,) for the m queries with a positive). Their means are ``curve_numbers``' top1_auc and
    map_auc."""
    top1, precision, has_positive = _per_query(side, labels, order_name, seed, distance)
    return top1.mean(axis=0), precision.mean(axis=0)[has_positive]


def _measured(side: SideOutputs, order_name: str, labels: np.ndarray, seed: int, distance: str
              ) -> tuple[dict, tuple[np.ndarray, np.ndarray]]:
    """``curve_numbers`` and ``per_query_scores`` from one ranking of the held-out pairs."""
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


def check_tags(record: dict) -> dict[str, str]:
    """The check as tags (on the map's registered version and its run): ``check`` is
    ``passed``, ``fallback`` (the l2 map is used) or ``warned`` (kept although it failed);
    ``check_reason`` its message (for a map that diverged, beginning "non-finite outputs")."""
    from components.evaluation.reports import check_outcome

    tags = {"check": check_outcome(record), "check_policy": record["policy"], "check_reason": record["message"][:4900]}
    if record.get("non_finite"):
        tags["check_non_finite"] = ", ".join(record["non_finite"])
    if "fallback_order" in record:
        tags.update(fallback_order=record["fallback_order"]["order"],
                    fallback_order_reason=record["fallback_order"]["message"][:4900])
    return tags


def check_metrics(record: dict) -> dict[str, float]:
    """The check's numbers as metrics: ``check.map.*`` and ``check.reference.*``."""
    out = {f"check.{side}.{key}": record[name][key] for side, name in (("map", "candidate"), ("reference", "reference"))
           for key in ("top1_0", "map_0", "top1_auc", "map_auc")}
    out.update({f"check.map.{key}_support": record["candidate"][f"{key}_support"] for key in ("top1_auc", "map_auc")
                if f"{key}_support" in record["candidate"]})
    out["check.passed"] = float(record["passed"])
    if "non_finite" in record:
        out["check.non_finite"] = float(bool(record["non_finite"]))
    if "fallback_order" in record:
        decision = record["fallback_order"]
        out.update({f"check.fallback.{order}_{key}": decision[order][key] for order in ("sigma", "random")
                    for key in ("top1_auc", "map_auc")})
        out["check.fallback.sigma_kept"] = float(decision["order"] == "sigma")
    return out


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
    advice = ("with few held-out pairs, a larger align.{m}.validation_fraction or a lower "
              "align.{m}.check_confidence; try a larger align.{m}.min_steps, align.{m}.uncertainty_weighting: normalized, more training "
              "pairs, or align.{m}.check: fallback to use the l2 map").format(m=method)
    worse = " and ".join(short)
    if config.check == "fail":
        raise MapCheckError(f"map check failed: {method} is not shown to match the l2-only map in {worse} "
                            f"(tolerance {tolerance}, confidence {confidence}). {summary}. What to try: {advice}")
    action = "fallback" if config.check == "fallback" else "kept"
    verb = "uses the l2-only map instead" if action == "fallback" else "keeps the map (check: warn)"
    return MapCheck(method, config.check, False, action, numbers, baseline, tolerance,
                    confidence=confidence,
                    message=f"{method} is not shown to match the l2-only map in {worse}; the stage {verb}. {summary}")


def outputs_on(h, pairs) -> SideOutputs:
    """A map's sides on held-out pairs: h(old) with log sigma^2, or a unified map's T_g(old)
    and T_q(new)."""
    from components.experiment.models import UnifiedMaps
    from components.experiment.inference import apply_alignment, apply_unified

    if isinstance(h, UnifiedMaps):
        gallery_old, query = apply_unified(h, pairs.old, pairs.new)
        return SideOutputs(gallery_old, query)
    transformed, log_sigma2 = apply_alignment(h, pairs.old)
    return SideOutputs(transformed, pairs.new, log_sigma2)


def check_map(method: str, config: AlignConfig, h, reference, pairs, *, distance: str = "l2") -> MapCheck:
    """``judge`` on held-out ``pairs`` for a trained map ``h`` and its trained l2-only ``reference``."""
    return judge(method, config, outputs_on(h, pairs), outputs_on(reference, pairs), pairs.rows, distance=distance)


def fallback_config(config: AlignConfig) -> AlignConfig:
    """What a fallback map is: the l2-only map, with an uncertainty head fitted on it (for the
    method's loss terms) when the method orders by sigma."""
    data = reference_config(config).model_dump()
    if config.uncertainty:
        data.update(uncertainty=True, disc=config.disc, uncertainty_weighting="detached",
                    uncertainty_lambda=config.uncertainty_lambda, disc_label_smoothing=config.disc_label_smoothing)
    return AlignConfig.model_validate(data)


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


def fallback_map(method: str, config: AlignConfig, reference, pairs: tuple, held, classifier, *,
                 distance: str = "l2", device=None) -> tuple:
    """What a map that failed its check under ``fallback`` is replaced by: the l2-only
    ``reference``; when the method orders by sigma, with an uncertainty head fitted on it on the
    training ``pairs`` (old, new, class rows), kept only if ``judge_order`` shows its sigma order
    to be at least as good as random on the ``held`` out pairs. Returns (map, its configuration,
    the order decision or None when the method has no sigma order)."""
    from components.experiment.map_training import fit_uncertainty_head

    used = fallback_config(config)
    if not used.uncertainty:
        return reference, used, None
    fitted = fit_uncertainty_head(reference, used, *pairs, classifier, device=device)
    decision = judge_order(method, config, outputs_on(fitted, held), held.rows, distance=distance)
    if decision["order"] == "sigma":
        return fitted, used, decision
    return reference, reference_config(config), decision
