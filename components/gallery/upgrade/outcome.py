"""What one run of an upgrade returns (``UpgradeRun.run``, the flow ``upgrade_flow``), as typed
records: the CLI prints their fields, ``--json`` writes them (``as_dict``), the deployment's flow
run carries them as its state's data, tests read them. Which fields are set depends on
``state``; each is written once, where the run decides it. A rejection's Prefect event is made
here too (``rejection_event``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from fastfill.components.platform.registry import ModelRef

State = Literal["complete", "rejected", "paused", "up-to-date", "no target"]
Stopped = Literal["budget", "recommended"]


@dataclass(frozen=True)
class Decision:
    """The promotion decision at the end of an upgrade: passed or not, why, the gate's numbers
    (None ungated) and the tags the registry records, with the versions it judged. The decider
    makes it (``UpgradeDecider.decide``); the store keeps it as the upgrade's decision.json
    (``to_dict``/``from_dict``, whose keys are that file's: ``upgrade`` is ``upgrade_id``), with
    when it was ``decided`` and when the registry followed (``registry_recorded``)."""

    upgrade_id: str
    passed: bool
    reasons: list[str]
    numbers: dict | None
    tags: dict = field(default_factory=dict)
    champion: ModelRef | None = None
    new: ModelRef | None = None
    decided: str | None = None  # when it was recorded; None before
    registry_recorded: str | None = None  # when the registry followed; None before

    @property
    def gated(self) -> bool:
        """The gate measured it (an ungated upgrade passes with no numbers)."""
        return self.numbers is not None

    @property
    def verdict(self) -> str:
        return ("passed" if self.passed else "rejected") if self.gated else "ungated"

    def to_dict(self) -> dict:
        """decision.json's record, its keys in their stored order."""
        return {"upgrade": self.upgrade_id, "decided": self.decided, "passed": self.passed,
                "reasons": list(self.reasons), "numbers": self.numbers, "tags": self.tags,
                "champion": self.champion.to_dict() if self.champion else None,
                "new": self.new.to_dict() if self.new else None, "registry_recorded": self.registry_recorded}

    @classmethod
    def from_dict(cls, record: dict) -> Decision:
        """A stored decision.json (a record without tags or versions reads as none)."""
        champion, new = record.get("champion"), record.get("new")
        return cls(upgrade_id=record["upgrade"], passed=bool(record["passed"]),
                   reasons=list(record.get("reasons") or []), numbers=record.get("numbers"),
                   tags=dict(record.get("tags") or {}), champion=ModelRef.from_dict(champion) if champion else None,
                   new=ModelRef.from_dict(new) if new else None, decided=record.get("decided"),
                   registry_recorded=record.get("registry_recorded"))

    def gate_numbers(self) -> GateNumbers | None:
        """What the CLI says of the gate's numbers (None ungated)."""
        return GateNumbers.from_dict(self.numbers) if self.numbers is not None else None

    def gate_fields(self) -> dict:
        """What a run's result shows of it (``promotion`` in the upgrade's JSON)."""
        return {"passed": self.passed, "reasons": list(self.reasons), "numbers": self.numbers}


@dataclass(frozen=True)
class GateNumbers:
    """The measured gate's headline numbers (``Decision.numbers`` holds them all, as decision.json
    stores them): the champion's top-1, the challenger's mean top-1 along the backfill, the mean
    NFR@1, and the fraction of the gallery where the gain was reached (None: never)."""

    champion_top1: float
    top1_auc: float
    nfr1_mean: float
    fraction_to_gain: float | None

    @classmethod
    def from_dict(cls, numbers: dict) -> GateNumbers:
        return cls(champion_top1=numbers["champion_top1"], top1_auc=numbers["top1_auc"],
                   nfr1_mean=numbers["nfr1_mean"], fraction_to_gain=numbers.get("fraction_to_gain"))


@dataclass(frozen=True)
class Recommendation:
    """The advisor's recommended stop (``advisor.recommend``, or as advice.json keeps it): for a marginal
    gain below ``gain_below`` points per 5%, stop at ``fraction`` of the gallery, where the
    prediction's ``metric`` (top-1, or the label-free agreement) is ``at_stop``, against ``full``
    at 100%. ``to_dict``: the record as it was made or read, whichever version of fastfill wrote it."""

    gain_below: float
    fraction: float
    metric: str  # top1 (a record without the key is top-1's) or agreement
    at_stop: float
    full: float
    record: dict

    @classmethod
    def from_dict(cls, record: dict) -> Recommendation:
        metric = record.get("metric", "top1")
        return cls(gain_below=record["gain_below"], fraction=record["fraction"], metric=metric,
                   at_stop=record[metric], full=record[f"{metric}_full"], record=dict(record))

    def to_dict(self) -> dict:
        return dict(self.record)


@dataclass(frozen=True)
class Advice:
    """The budget advisor's predicted curve (``top1`` and ``map`` with labels or judged queries,
    ``agreement`` without) and the stop it recommends (see advisor.describe)."""

    recommendation: Recommendation | None
    fractions: list[float]
    top1: list[float] | None = None
    map: list[float] | None = None
    agreement: list[float] | None = None


@dataclass(frozen=True)
class BackfillSummary:
    """How far one run's backfill got (``lifecycle.Backfill.summary``)."""

    upgrade_id: str
    chunks_done: int
    chunks: int
    items_done: int
    items: int
    fraction: float  # items_done / items
    complete: bool  # every chunk landed
    failed_images: int  # items whose image could not be read (they keep h(old))


@dataclass(frozen=True)
class UpgradeResult:
    """``state``: complete (the gallery serves the new model), rejected (the gate said no; the
    champion's features serve), paused (a budget or the advised stop; the same command goes on),
    up-to-date, or no target. The backfill's counts come with every run that planned or resumed;
    ``promotion`` with a measured gate (the decision, shown as ``Decision.gate_fields``);
    ``advice`` where the advisor predicted the curve; ``resumed_ending`` and ``decision`` when
    this run completed the end a killed run had decided."""

    state: State
    items: int
    items_done: int
    fraction: float
    complete: bool
    mlflow_run_id: str | None = None  # the upgrade's MLflow run
    message: str | None = None  # what the run said, for up-to-date, no target and paused
    model: str | None = None  # the gallery's model (up-to-date, no target)
    upgrade_id: str | None = None  # ``upgrade`` in the JSON (``as_dict``)
    chunks_done: int | None = None
    chunks: int | None = None
    failed_images: int | None = None
    stopped: Stopped | None = None  # why a paused run stopped
    advice: Advice | None = None
    promotion: Decision | None = None
    resumed_ending: bool = False
    decision: Decision | None = None  # the decision (decision.json) this run completed

    @property
    def reasons(self) -> list[str]:
        """Why the gate rejected: this run's gate, or the decision it completed."""
        if self.promotion is not None and self.promotion.reasons:
            return list(self.promotion.reasons)
        return list(self.decision.reasons) if self.decision is not None else []

    def with_message(self, message: str) -> UpgradeResult:
        return replace(self, message=message)

    def as_dict(self) -> dict:
        """The fields as plain JSON-ready values (the decisions as ``gate_fields`` and decision.json),
        in their order; the upgrade's id as ``upgrade``."""
        fields = {("upgrade" if key == "upgrade_id" else key): value
                  for key, value in asdict(replace(self, promotion=None, decision=None)).items()}
        if self.advice is not None and self.advice.recommendation is not None:  # the record, not the typed fields
            fields["advice"]["recommendation"] = self.advice.recommendation.to_dict()
        fields["promotion"] = self.promotion.gate_fields() if self.promotion is not None else None
        fields["decision"] = self.decision.to_dict() if self.decision is not None else None
        return fields


def backfilled(summary: BackfillSummary, mlflow_run_id: str | None, advice: Advice | None) -> UpgradeResult:
    """The result of a run's backfill, before its end; the state is decided after (paused, or
    the end's)."""
    return UpgradeResult(state="complete" if summary.complete else "paused", items=summary.items,
                         items_done=summary.items_done, fraction=summary.fraction, complete=summary.complete,
                         mlflow_run_id=mlflow_run_id, upgrade_id=summary.upgrade_id, chunks_done=summary.chunks_done,
                         chunks=summary.chunks, failed_images=summary.failed_images, advice=advice)


REJECTED_EVENT = "fastfill.upgrade.rejected"


def rejection_event(result: UpgradeResult, store_uri: str, model_uri: str) -> dict:
    """The event a rejection by the gate emits (``prefect.events.emit_event``'s arguments):
    ``fastfill.upgrade.rejected`` with the gallery as its resource, and as payload the upgrade,
    the store, the model, the reasons, the gate's numbers (those that are numbers) and the
    upgrade's MLflow run, for an Automation to act on."""
    upgrade_id = result.upgrade_id or (result.decision.upgrade_id if result.decision is not None else None)
    numbers = {k: v for k, v in ((result.promotion.numbers if result.promotion else None) or {}).items()
               if isinstance(v, int | float | None)}
    return {"event": REJECTED_EVENT,
            "resource": {"prefect.resource.id": f"fastfill.gallery.{store_uri}", "prefect.resource.name": store_uri},
            "payload": {"upgrade": upgrade_id, "store": store_uri, "model": model_uri, "reasons": result.reasons,
                        "numbers": numbers, "mlflow_run_id": result.mlflow_run_id}}
