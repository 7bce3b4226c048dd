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

``decide_map`` is the check as the align stage and the gallery upgrade run it: the reference
(handed over, or trained here), the judgment, the fallback and the order to backfill in. How
maps are scored and judged is ``map_judging``'s; its names are importable from here too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastfill.components.experiment.map_judging import (
    CHECK_POINTS,
    POLICIES,
    MapCheck,
    MapCheckError,
    SideOutputs,
    curve_numbers,
    judge,
    judge_order,
    non_finite_outputs,
    non_finite_rows,
)
from fastfill.components.experiment.map_validation import held_out
from fastfill.components.platform.config import AlignConfig

__all__ = ["CHECK_POINTS", "POLICIES", "MapCheck", "MapCheckError", "MapDecision", "SideOutputs", "check_map",
           "check_metrics", "check_tags", "curve_numbers", "decide_map", "fallback_config", "fallback_map",
           "held_out", "is_reference", "judge", "judge_order", "non_finite_outputs", "non_finite_rows",
           "outputs_on", "own_reference", "reference_config", "shares_reference", "skip_reason"]

# The settings the l2-only reference shares with the map it checks: same pairs, same split,
# same schedule, same seed. Everything else is FCT's (l2 only, an MLP, no uncertainty head).
_SHARED = ("l2_reduction", "epochs", "min_steps", "warmup_epochs", "batch_size", "lr", "weight_decay",
           "validation_fraction", "validation_items", "seed", "precision", "conditioning", "patience")


def reference_config(config: AlignConfig) -> AlignConfig:
    """The l2-only map a map is checked against: FCT with the map's schedule and ``hidden``
    widths (for an RBT or unified map, ``hidden`` gives only the reference's widths)."""
    shared = {name: getattr(config, name) for name in _SHARED}
    return AlignConfig(l2=True, disc=False, uncertainty=False, architecture="mlp", hidden=list(config.hidden), **shared)


def shares_reference(config: AlignConfig) -> bool:
    """The map's network trains exactly as its l2-only reference would (``separate``: psi learns
    beside a map trained on the l2 term alone, an MLP of the reference's widths), so the map
    without its head is that reference and the check need not train another."""
    return (config.uncertainty and config.uncertainty_weighting == "separate" and config.l2 and not config.disc
            and config.architecture == "mlp")


def own_reference(h):
    """The l2-only reference a ``shares_reference`` map carries: a copy of its network, without psi."""
    reference = copy.deepcopy(h).eval()
    reference.uncertainty = None
    reference.architecture = {**h.architecture, "uncertainty": False}
    return reference


def is_reference(config: AlignConfig) -> bool:
    """The map is an l2-only MLP: it is its own reference and needs no check."""
    return config.l2 and not config.disc and not config.uncertainty and config.architecture == "mlp"


def check_tags(record: dict) -> dict[str, str]:
    """The check as tags (on the map's registered version and its run): ``check`` is
    ``passed``, ``fallback`` (the l2 map is used) or ``warned`` (kept although it failed);
    ``check_reason`` its message (for a map that diverged, beginning "non-finite outputs")."""
    from fastfill.components.evaluation.reports import check_outcome
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


def outputs_on(h, pairs) -> SideOutputs:
    """A map's sides on held-out pairs: h(old) with log sigma^2, or a unified map's T_g(old)
    and T_q(new)."""
    from fastfill.components.experiment.inference import apply_alignment, apply_unified
    from fastfill.components.experiment.models import UnifiedMaps
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


# a map's training pairs: old features, new features, class rows
Pairs = tuple[np.ndarray, np.ndarray, np.ndarray]


def fallback_map(method: str, config: AlignConfig, reference, pairs: Pairs, held, classifier, *,
                 distance: str = "l2", device=None) -> tuple:
    """What a map that failed its check under ``fallback`` is replaced by: the l2-only
    ``reference``; when the method orders by sigma, with an uncertainty head fitted on it on the
    training ``pairs`` (old, new, class rows), kept only if ``judge_order`` shows its sigma order
    to be at least as good as random on the ``held`` out pairs. Returns (map, its configuration,
    the order decision or None when the method has no sigma order)."""
    from fastfill.components.experiment.map_training import fit_uncertainty_head
    used = fallback_config(config)
    if not used.uncertainty:
        return reference, used, None
    fitted = fit_uncertainty_head(reference, used, *pairs, classifier, device=device)
    decision = judge_order(method, config, outputs_on(fitted, held), held.rows, distance=distance)
    if decision["order"] == "sigma":
        return fitted, used, decision
    return reference, reference_config(config), decision


def skip_reason(method: str, config: AlignConfig, *, check_l2_only: bool = False) -> str | None:
    """Why a map is used without a check before its pairs are looked at: the check is off, or the
    map is l2-only and so its own reference (unless ``check_l2_only``); None when it is checked."""
    if config.check == "off":
        return f"align.{method}.check is off"
    if is_reference(config) and not check_l2_only:
        return "an l2-only map is the map check's own reference"
    return None


@dataclass
class MapDecision:
    """What the map check decided. ``use``: ``candidate`` (the map itself: it passed, was kept
    under warn, or was not checked), ``fitted`` (the l2-only reference with an uncertainty head
    fitted on it, a map of the method) or ``reference`` (the l2-only reference alone); ``map``
    is that map, ``config`` its configuration and ``order`` the order to backfill it in.
    ``record`` is the check's record (check.json, its tags and metrics: ``check_tags``,
    ``check_metrics``), None when ``skipped`` says why the map is used unchecked. ``reference``
    is the l2-only map the check measured against, and ``reference_trained`` whether the check
    trained it (rather than being handed a ready one)."""

    use: str
    map: object
    config: AlignConfig
    order: str
    record: dict | None = None
    skipped: str | None = None
    reference: object = None
    reference_trained: bool = False


def _quiet(_: str) -> None:
    pass


def decide_map(method: str, config: AlignConfig, candidate, training: Pairs, reference: Callable[[], object],
               classifier, *, checking: Pairs | None = None, order: str | None = None, distance: str = "l2",
               device=None, log: Callable[[str], None] = _quiet, pairs_from: str | None = None,
               check_l2_only: bool = False, keep_reference: Callable[[object], None] | None = None,
               checkpoint=None) -> MapDecision:
    """The map check of a trained ``candidate`` map of ``method``, and which map is used after it.

    ``training`` is (old, new, class rows) as the map trained on them; ``checking`` (old, new,
    labels; default ``training``) gives the held-out pairs (``held_out``). ``reference()`` returns
    a ready l2-only reference for these pairs, or None: then it is trained here on ``training``
    with ``reference_config(config)`` (resumable from ``checkpoint``) and handed to
    ``keep_reference`` at once, so it is kept also when the check fails. ``order`` is the
    configured backfill order (default: sigma when the method has an uncertainty head, else
    random); a map that falls back gets a fitted head only when it is sigma (``fallback_map``),
    and then the order that head is shown to earn. Under ``check: fail`` a failed check raises
    MapCheckError. ``log`` takes progress lines; ``pairs_from`` names the pairs in them."""
    from fastfill.components.experiment.map_training import train_alignment
    order = order or ("sigma" if config.uncertainty else "random")
    reason = skip_reason(method, config, check_l2_only=check_l2_only)
    held = None if reason else held_out(config, *(training if checking is None else checking), method)
    if held is None:
        return MapDecision("candidate", candidate, config, order,
                           skipped=reason or f"align.{method}.validation_fraction is 0")
    ready = reference()
    if ready is None and shares_reference(config):
        ready = own_reference(candidate)
        log("map check: the map's network is its own l2-only reference (it trained on the l2 term alone, psi "
            "beside it), so none is trained")
        if keep_reference is not None:
            keep_reference(ready)
    trained = ready is None
    if trained:
        log(f"map check: training the l2-only reference on the same {len(training[0])} pairs"
            + (f" ({pairs_from})" if pairs_from else "") + f" (FCT with {method}'s schedule)")
        ready, _ = train_alignment(reference_config(config), *training, classifier, device=device,
                                   checkpoint=checkpoint, log=log)
        if keep_reference is not None:
            keep_reference(ready)
    result = check_map(method, config, candidate, ready, held, distance=distance)
    log(f"map check ({config.check})" + (f" on {pairs_from}" if pairs_from else "") + f": {result.message}")
    record = result.to_dict()
    decided: dict[str, Any] = dict(record=record, reference=ready, reference_trained=trained)
    if result.action != "fallback":
        return MapDecision("candidate", candidate, config, order, **decided)
    used, used_config, judged = ready, reference_config(config), None
    if order == "sigma" and shares_reference(config):  # the check just judged this map's sigma order: random
        log("map check fallback: the map's sigma order is not shown to beat a random order of the same network; "
            "random order")
        order = "random"
    elif order == "sigma":
        used, used_config, judged = fallback_map(method, config, ready, training, held, classifier,
                                                 distance=distance, device=device)
    if judged is not None:
        log(f"map check fallback: {judged['message']}")
        record["fallback_order"] = judged
        order = judged["order"]
    return MapDecision("reference" if used is ready else "fitted", used, used_config, order, **decided)
