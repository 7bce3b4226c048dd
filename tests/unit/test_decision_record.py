"""The upgrade's decision as one type (``outcome.Decision``): decision.json reads into it and is
written from it byte for byte as before, so galleries decided by earlier versions still read and
complete their end."""

from __future__ import annotations

import json

from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.store.base import json_bytes
from fastfill.components.gallery.upgrade import ending
from fastfill.components.gallery.upgrade.outcome import Decision
from fastfill.components.gallery.upgrade.planning import DECISION, upgrade_key
from fastfill.components.platform.registry import ModelRef

OLD, NEW = ModelRef("embedder", "1", 8), ModelRef("embedder", "2", 16)
UPGRADE_ID = "embedder-v1-to-embedder-v2"
# decision.json as the product wrote it before the type: the gate's numbers, then the registry's step
STORED = {"upgrade": UPGRADE_ID, "decided": "2026-01-01T00:00:00+00:00", "passed": False,
          "reasons": ["top-1 never exceeds the champion's along the backfill"],
          "numbers": {"champion_top1": 0.5, "top1_auc": 0.4, "fraction_to_gain": None},
          "tags": {"promotion": "rejected", "promotion.upgrade": UPGRADE_ID},
          "champion": OLD.to_dict(), "new": NEW.to_dict(), "registry_recorded": "2026-01-01T00:00:05+00:00"}


def test_a_stored_decision_reads_and_writes_back_byte_for_byte():
    decided = Decision.from_dict(json.loads(json_bytes(STORED)))
    assert (decided.upgrade_id, decided.passed, decided.champion, decided.new) == (UPGRADE_ID, False, OLD, NEW)
    assert decided.gated and decided.verdict == "rejected"
    assert json_bytes(decided.to_dict()) == json_bytes(STORED)
    assert decided.gate_fields() == {"passed": False, "reasons": STORED["reasons"], "numbers": STORED["numbers"]}


def test_an_ungated_decision_has_no_verdict_of_the_gate():
    assert Decision(UPGRADE_ID, True, [], None).verdict == "ungated"


def test_the_store_keeps_the_record_as_before(tmp_path):
    store = open_store(str(tmp_path / "store"))
    written = ending.write_decision(store, Decision(UPGRADE_ID, True, [], None, {"promotion": "ungated"},
                                                    champion=OLD, new=NEW))
    stored = store.get_json(upgrade_key(UPGRADE_ID, DECISION))
    assert set(stored) == set(STORED) and stored["decided"] == written.decided and stored["registry_recorded"] is None
    assert ending.write_decision(store, Decision(UPGRADE_ID, False, ["again"], None)) == written  # written once
    assert ending.decision(store, UPGRADE_ID) == written
    recorded = ending.mark_registry_recorded(store, UPGRADE_ID)
    assert recorded.registry_recorded and ending.decision(store, UPGRADE_ID) == recorded


def test_a_record_written_before_is_completed_as_it_stands(tmp_path):
    store = open_store(str(tmp_path / "store"))
    store.put_json(upgrade_key(UPGRADE_ID, DECISION), {**STORED, "registry_recorded": None})
    before = store.get(upgrade_key(UPGRADE_ID, DECISION))
    assert ending.decision(store, UPGRADE_ID) == Decision.from_dict({**STORED, "registry_recorded": None})
    ending.mark_registry_recorded(store, UPGRADE_ID)
    after = json.loads(store.get(upgrade_key(UPGRADE_ID, DECISION)))
    assert {**after, "registry_recorded": None} == json.loads(before) and after["registry_recorded"]
