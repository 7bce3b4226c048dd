"""What one run of an upgrade returns (``flows.upgrade.upgrade_flow``), as one typed value: the
CLI prints it, the deployment's flow run carries it as its state's data, tests read it. Which
keys are present depends on ``state``; each is written once, where the run decides it."""

from __future__ import annotations

from typing import Literal, NotRequired, Required, TypedDict

State = Literal["complete", "rejected", "paused", "up-to-date", "no target"]


class Promotion(TypedDict):
    """The promotion gate's decision: passed or not, why, and its numbers (None ungated)."""

    passed: bool
    reasons: list[str]
    numbers: dict | None


class Advice(TypedDict, total=False):
    """The budget advisor's predicted curve and the stop it recommends (see advisor.describe)."""

    recommendation: dict | None
    fractions: list[float]
    top1: list[float]
    map: list[float]
    agreement: list[float]


class UpgradeResult(TypedDict, total=False):
    """``state``: complete (the gallery serves the new model), rejected (the gate said no; the
    champion's features serve), paused (a budget or the advised stop; the same command goes on),
    up-to-date, or no target. The backfill's counts come with every run that planned or resumed;
    ``promotion`` with a measured gate; ``advice`` where the advisor predicted the curve;
    ``resumed_ending`` and ``decided`` when this run completed the end a killed run had decided."""

    state: Required[State]
    message: str  # what the run said, for up-to-date, no target and paused
    model: str  # the gallery's model (up-to-date, no target)
    upgrade: str  # the upgrade's id
    chunks_done: int
    chunks: int
    items_done: int
    items: int
    fraction: float  # items_done / items
    complete: bool  # every chunk landed
    failed_images: int  # items whose image could not be read (they keep h(old))
    stopped: Literal["budget", "recommended"]  # why a paused run stopped
    mlflow_run_id: str | None  # the upgrade's MLflow run
    advice: Advice
    promotion: Promotion
    resumed_ending: bool
    decided: dict  # the decision.json this run completed
    champion: NotRequired[dict]  # internal: the champion the end measured against, popped before returning


def backfilled(summary: dict, mlflow_run_id: str | None, advice: Advice | None) -> UpgradeResult:
    """The result of a run's backfill (``lifecycle.Backfill.summary``), before its end; the state
    is decided after (paused, or the end's)."""
    return {"state": "complete" if summary["complete"] else "paused", **summary, "mlflow_run_id": mlflow_run_id,
            **({"advice": advice} if advice else {})}
