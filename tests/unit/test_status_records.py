"""`fastfill upgrade status --json` read back: the gallery's state is typed records (the lock, the
upgrade in progress with its prediction, failed images and decision, the served index), and
``GalleryStatus.from_dict`` of a real status document gives the document again by ``to_dict``,
key for key and in the same order."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from fastfill.cli import app
from fastfill.components.gallery.advice import advisor
from fastfill.components.gallery.store.lock import LOCK, LockRecord
from fastfill.components.gallery.upgrade import backfill, ending
from fastfill.components.gallery.upgrade.backfill import FailedImages
from fastfill.components.gallery.upgrade.outcome import Decision, Recommendation
from fastfill.components.gallery.upgrade.status import (
    GalleryStatus,
    PredictedCurve,
    ServedIndex,
    UpgradeInProgress,
    gallery_status,
)
from tests.gallery_cases import NEW, OLD, _gallery, _plan

runner = CliRunner()


def _status_document(store_uri: str) -> dict:
    """`fastfill upgrade status --json`'s document, its schema key left out."""
    result = runner.invoke(app, ["upgrade", "status", "--store", store_uri, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document.pop("schema") == "fastfill.upgrade.status/1"
    return document


def _read_back(document: dict) -> GalleryStatus:
    """The document read as a status, which writes it again key for key, in its order."""
    state = GalleryStatus.from_dict(document)
    again = state.to_dict()
    assert again == document and list(again) == list(document)
    assert json.dumps(again) == json.dumps(document)  # nested keys in their order too
    return state


def _advice(metric: str, items: int) -> dict:
    """An advice.json as the advisor writes it, with its recommended stop."""
    fractions = [i / 20 for i in range(21)]
    if metric == "agreement":
        advice = {"fractions": fractions, "agreement": [0.5 + 0.5 * f for f in fractions], "metric": "agreement",
                  "sample": 12, "k": 5, "items": items}
    else:
        advice = {"fractions": fractions, "top1": [0.4 + 0.3 * f ** 0.5 for f in fractions],
                  "map": [0.3 + 0.2 * f for f in fractions], "top1_se": [0.01 + 0.001 * i for i in range(21)],
                  "sample": 40, "items": items}
    advice["recommendation"] = advisor.recommend(advice, 1.0)
    return advice


@pytest.mark.parametrize("metric", ["top1", "agreement"])
def test_a_paused_upgrade_with_its_prediction_an_expired_lock_and_a_decision_reads_back(mid_upgrade, metric):
    gallery, plan, _, _ = mid_upgrade
    gallery.store.put_json(advisor.advice_key(plan.upgrade_id), _advice(metric, plan.num_items))
    gallery.store.put_json(LOCK, {"upgrade": plan.upgrade_id, "host": "elsewhere", "pid": 4242, "since": "2020-01-01T00:00:00",
                                  "token": "secret-token", "expires": time.time() - 10})
    ending.write_decision(gallery.store, Decision(plan.upgrade_id, False, ["worse"], {"champion_top1": 0.5}, champion=OLD,
                                                  new=NEW))
    document = _status_document(gallery.store.uri)
    assert "token" not in document["lock"] and document["lock"]["expired"] is True
    state = _read_back(document)

    assert state.state == "ending interrupted" and not state.lock_live
    assert isinstance(state.lock, LockRecord) and state.lock.expired
    assert (state.lock.upgrade_id, state.lock.pid, state.lock.host) == (plan.upgrade_id, 4242, "elsewhere")
    upgrade = state.upgrade
    assert isinstance(upgrade, UpgradeInProgress) and upgrade.chunks_done == 3 and upgrade.items_done == 21
    assert isinstance(upgrade.decision, Decision) and upgrade.decision.passed is False
    assert upgrade.decision.upgrade_id == plan.upgrade_id and upgrade.decision.decided == document["upgrade"]["decision"][
        "decided"]
    predicted = upgrade.predicted
    assert isinstance(predicted, PredictedCurve) and isinstance(predicted.recommendation, Recommendation)
    assert predicted.recommendation.metric == metric and predicted.label_free == (metric == "agreement")
    curve = predicted.agreement if metric == "agreement" else predicted.top1
    assert curve is not None and list(curve) == [f"{10 * i}%" for i in range(11)]
    assert upgrade.failed_images is None and state.index is None  # the parts layout's, ingested
    # what the process read is what the document says
    assert gallery_status(gallery).to_dict() == document


def test_an_ending_whose_registry_step_is_missing_reads_back(tmp_path, models, data):
    gallery = _gallery(str(tmp_path / "store"), models, data)
    plan = _plan(gallery, models[2])
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, models[1])
    ending.write_decision(gallery.store, Decision(plan.upgrade_id, True, [], None, {"promotion": "ungated"}, champion=OLD,
                                                  new=NEW))
    ending.finish(gallery, plan)
    document = _status_document(gallery.store.uri)
    assert list(document["upgrade"]) == ["id", "to", "decision", "registry_recorded"]
    state = _read_back(document)
    assert state.state == "ending interrupted" and state.upgrade.registry_recorded is False
    assert state.upgrade.decision.passed and state.upgrade.to == NEW.uri and state.lock is None


def test_a_served_index_reads_back(tmp_path, models, data):
    gallery = _gallery(str(tmp_path / "store"), models, data, layout="lance")
    plan = _plan(gallery, models[2])
    backfill.backfill_chunk(gallery, plan.upgrade_id, 0, models[1])
    state = _read_back(_status_document(gallery.store.uri))
    assert isinstance(state.index, ServedIndex) and state.index.problem is None
    assert state.index.serving == NEW.uri and state.index.as_manifest_says and state.index.view == gallery.index.view
    assert state.state == "paused" and state.upgrade.chunks_done == 1


def test_failed_images_read_back_as_shown():
    failed = [{"position": i, "id": 500 + i, "uri": f"img-{i:05d}.png", "reason": "missing: gone"} for i in range(25)]
    shown = FailedImages.of(failed, 20)
    assert shown.count == 25 and len(shown.items) == 20 and FailedImages.of(failed).items == failed
    assert FailedImages.from_dict(json.loads(json.dumps(shown.to_dict()))) == shown
