"""Undoing upgrades in the store (components.gallery.upgrade.reversal and garbage: abort, rollback, start_over, gc of
aborted work), the map training's progress lines, the CLI's progress default and the flows'
configuration overrides; on a local folder, no Prefect."""

import os

import numpy as np
import pytest

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.upgrade import backfill, ending, garbage, planning, reversal
from fastfill.components.gallery.upgrade.outcome import Decision
from fastfill.components.gallery.upgrade.status import gallery_status
from tests.gallery_cases import NEW, OLD, _gallery, _plan


def _finish_all(gallery, plan, new):
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    return ending.finish(gallery, plan)


def test_an_aborted_upgrade_goes_back_to_the_champion_and_is_planned_again_from_scratch(tmp_path, models, data):
    _, new, h = models
    gallery = _gallery(str(tmp_path / "g"), models, data)
    store = gallery.store
    before = {key: store.get(key) for key in store.list("features/")}
    plan = _plan(gallery, h)
    first = [backfill.backfill_chunk(gallery, plan.upgrade_id, c, new)["token"] for c in (0, 1, 2)]
    assert reversal.abortable(gallery) == plan.upgrade_id

    record = reversal.abort(gallery, plan.upgrade_id, by={"user": "ops", "host": "h", "pid": 1})
    assert gallery.manifest(refresh=True)["upgrade"] is None and gallery.model == OLD
    assert {key: store.get(key) for key in store.list("features/")} == before  # the champion's, untouched
    saved = store.get_json(planning.upgrade_key(plan.upgrade_id, reversal.ABORTED))
    assert saved == record.to_dict() and record.by["user"] == "ops" and record.stage == "backfilling"
    assert reversal.Aborted.from_dict(saved) == record  # the stored record reads back as it was written
    assert (record.chunks_done, record.chunks, record.items_done) == (3, 8, 21)
    assert record.source == OLD.uri and record.to == NEW.uri and saved["from"] == OLD.uri
    assert gallery_status(gallery).state == "idle"
    with pytest.raises(GalleryError, match="no upgrade of .* is in progress .*nothing to abort"):
        reversal.abortable(gallery)

    # gc collects its working data and keeps its plan and the record of the abort
    deleted = garbage.collect_garbage(gallery)
    assert deleted["upgrade_objects"] > 0 and deleted["features"] == 0
    assert sorted(store.list(f"upgrades/{plan.upgrade_id}/")) == [planning.upgrade_key(plan.upgrade_id, reversal.ABORTED),
                                                         planning.plan_key(plan.upgrade_id)]

    # asked for again: nothing of the aborted attempt is left to resume
    undone = reversal.start_over(gallery, plan.upgrade_id)
    assert undone["ended"] == "aborted" and undone["upgrade"] == plan.upgrade_id
    assert store.list(f"upgrades/{plan.upgrade_id}/") == [] and reversal.start_over(gallery, plan.upgrade_id) is None
    again = _plan(gallery, h, chunk_size=5)  # another chunking: nothing of the old one may be used
    tokens = [backfill.backfill_chunk(gallery, again.upgrade_id, c, new)["token"] for c in (0, 1, 2)]
    assert not set(tokens) & set(first)  # recomputed, not found done
    _finish_all(gallery, again, new)
    assert gallery.model == NEW


def test_a_rejected_upgrade_asked_for_again_ungated_is_planned_from_scratch(tmp_path, models, data):
    _, new, h = models
    gallery = _gallery(str(tmp_path / "g"), models, data)
    store = gallery.store
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    decided = ending.write_decision(store, Decision(plan.upgrade_id, False, ["worse"], None, champion=OLD, new=plan.new))
    ending.reject(gallery, plan, decided)
    assert gallery.model == OLD and ending.rejection(store, plan.upgrade_id) is not None
    undone = reversal.start_over(gallery, plan.upgrade_id)
    assert undone["ended"] == "rejected" and undone["reasons"] == ["worse"]
    assert store.list(f"upgrades/{plan.upgrade_id}/") == []  # nothing to resume, no decision to complete
    again = _plan(gallery, h)
    _finish_all(gallery, again, new)
    assert gallery.model == NEW


def test_an_abort_cut_short_is_seen_and_completed(tmp_path, models, data):
    _, new, h = models
    gallery = _gallery(str(tmp_path / "g"), models, data)
    plan = _plan(gallery, h)
    backfill.backfill_chunk(gallery, plan.upgrade_id, 0, new)
    record = reversal.abort(gallery, plan.upgrade_id)
    gallery.write_manifest({**gallery.manifest(refresh=True), "upgrade": plan.upgrade_id})  # as if killed before the switch
    state = gallery_status(gallery)
    assert state.state == "abort interrupted" and "fastfill upgrade abort" in state.next
    assert reversal.abort(gallery, plan.upgrade_id) == record  # completed, the first record kept
    assert gallery.manifest(refresh=True)["upgrade"] is None
    # the same cut-short abort, then the upgrade asked for again: the gallery goes back before planning
    gallery.write_manifest({**gallery.manifest(refresh=True), "upgrade": plan.upgrade_id})
    assert reversal.start_over(gallery, plan.upgrade_id)["ended"] == "aborted"
    assert gallery.manifest(refresh=True)["upgrade"] is None and gallery.store.list(f"upgrades/{plan.upgrade_id}/") == []


def test_what_cannot_be_aborted_says_why(tmp_path, models, data):
    _, new, h = models
    gallery = _gallery(str(tmp_path / "g"), models, data)
    with pytest.raises(GalleryError, match="nothing to abort$"):
        reversal.abortable(gallery)
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.write_decision(gallery.store, Decision(plan.upgrade_id, True, [], None, champion=OLD, new=plan.new))
    with pytest.raises(GalleryError, match="is ending: its promotion decision \\(passed\\).*cannot be aborted; run "
                                           "`fastfill upgrade`"):
        reversal.abortable(gallery)
    ending.finish(gallery, plan)  # switched, the registry step not yet recorded
    with pytest.raises(GalleryError, match="has ended .*only its registry step is left"):
        reversal.abortable(gallery)
    ending.mark_registry_recorded(gallery.store, plan.upgrade_id)
    with pytest.raises(GalleryError, match=f"The last upgrade, {plan.upgrade_id}, finished on .*a finished upgrade cannot be "
                                           f"aborted; `fastfill gallery rollback` returns the gallery to {OLD.uri}"):
        reversal.abortable(gallery)

    other = _gallery(str(tmp_path / "rejected"), models, data)
    rejected = _plan(other, h)
    ending.reject(other, rejected, Decision(rejected.upgrade_id, False, ["worse"], None))
    with pytest.raises(GalleryError, match=f"The last upgrade, {rejected.upgrade_id}, was rejected by the promotion gate on "
                                           ".*it is over"):
        reversal.abortable(other)


def test_rollback_while_the_old_features_exist_and_not_after_gc(tmp_path, models, data):
    old_model, new, h = models
    gallery = _gallery(str(tmp_path / "g"), models, data)
    store = gallery.store
    old_features = gallery.all_features(OLD)
    with pytest.raises(GalleryError, match="nothing to roll back: .* since it was created"):
        reversal.rollback_target(gallery)
    plan = _plan(gallery, h)
    with pytest.raises(GalleryError, match="is in progress; drop it with `fastfill upgrade abort`"):
        reversal.rollback_target(gallery)
    _finish_all(gallery, plan, new)
    assert reversal.rollback_target(gallery) == (plan.upgrade_id, NEW, OLD)

    record = reversal.rollback(gallery, by={"user": "ops", "host": "h", "pid": 1})
    manifest = gallery.manifest(refresh=True)
    assert gallery.model == OLD and manifest["upgrade"] is None
    assert manifest["history"][-1]["by"] == reversal.ROLLBACK and manifest["history"][-1]["upgrade"] == plan.upgrade_id
    np.testing.assert_array_equal(gallery.all_features(OLD), old_features)
    assert store.get_json(planning.upgrade_key(plan.upgrade_id, reversal.ROLLED_BACK)) == record
    assert record["registry_recorded"] is None
    assert reversal.interrupted_rollback(gallery) == record
    assert gallery_status(gallery).state == "rollback interrupted"
    reversal.mark_rollback_recorded(store, plan.upgrade_id)
    assert reversal.interrupted_rollback(gallery) is None and gallery_status(gallery).state == "idle"
    with pytest.raises(GalleryError, match="already a rollback"):
        reversal.rollback_target(gallery)
    with pytest.raises(GalleryError, match="nothing to abort"):
        reversal.abortable(gallery)

    # the same upgrade again: planned from scratch, then finished; gc; now the old features are gone
    assert reversal.start_over(gallery, plan.upgrade_id)["ended"] == "rolled back"
    again = _plan(gallery, h)
    _finish_all(gallery, again, new)
    assert gallery.model == NEW and gallery.manifest()["history"][-1]["by"] == again.upgrade_id
    garbage.collect_garbage(gallery)
    assert store.list(f"features/{OLD.key}/") == []
    with pytest.raises(GalleryError, match="the old features were collected .* Re-ingest the gallery with the previous "
                                           f"model \\(`fastfill gallery ingest --model {OLD.uri}"):
        reversal.rollback_target(gallery)
    assert gallery.model == NEW  # refused: nothing changed


def test_a_search_kept_open_follows_a_rollback_and_an_abort(tmp_path, models, data):
    from fastfill.components.experiment.inference import embed
    from fastfill.components.gallery.search.index import GallerySearch

    old_model, new, h = models
    images, _ = data
    gallery = _gallery(str(tmp_path / "g"), models, data)
    plan = _plan(gallery, h)
    searcher = GallerySearch(gallery)
    assert searcher.query_model == NEW
    reversal.abort(gallery, plan.upgrade_id)
    searcher.refresh()
    assert searcher.query_model == OLD and searcher.upgrade_id is None
    ids, _ = searcher.search(embed(old_model, images[:3]), k=1)
    assert list(ids[:, 0]) == [1000, 1001, 1002]  # the champion's features: each item finds itself

    reversal.start_over(gallery, plan.upgrade_id)
    again = _plan(gallery, h)
    _finish_all(gallery, again, new)
    searcher.refresh()
    assert searcher.query_model == NEW
    reversal.rollback(gallery)
    searcher.refresh()
    assert searcher.query_model == OLD and searcher.rebuilds >= 2
    ids, _ = searcher.search(embed(old_model, images[:3]), k=1)
    assert list(ids[:, 0]) == [1000, 1001, 1002]


def test_gc_keeps_a_rollback_record_and_an_unended_upgrade(tmp_path, models, data):
    _, new, h = models
    gallery = _gallery(str(tmp_path / "g"), models, data)
    plan = _plan(gallery, h)
    _finish_all(gallery, plan, new)
    reversal.rollback(gallery)
    garbage.collect_garbage(gallery)
    kept = set(gallery.store.list(f"upgrades/{plan.upgrade_id}/"))
    assert planning.upgrade_key(plan.upgrade_id, reversal.ROLLED_BACK) in kept and planning.plan_key(plan.upgrade_id) in kept
    assert gallery.store.list(f"features/{NEW.key}/") == []  # the rolled-back model's features are garbage now


def test_a_long_map_training_says_it_is_alive(monkeypatch):
    """Every epoch of a usual run is logged with its loss and held-out numbers; a long run of short
    epochs at least every PROGRESS_SECONDS."""
    import torch

    from fastfill.components.experiment import map_training
    from fastfill.components.experiment.map_training import train_alignment
    from fastfill.components.platform.config import AlignConfig

    rng = np.random.default_rng(0)
    old = rng.normal(size=(200, 6)).astype(np.float32)
    new = (old @ rng.normal(size=(6, 8))).astype(np.float32)
    labels = rng.integers(0, 3, size=200)
    classifier = torch.nn.Linear(8, 3)
    lines: list[str] = []
    config = AlignConfig(hidden=[8], epochs=4, warmup_epochs=1, batch_size=32, min_steps=0, disc=True, uncertainty=True)
    train_alignment(config, old, new, labels, classifier, device=torch.device("cpu"), log=lines.append)
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(" ", 2)[1] for line in epochs] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(" s" in line and "loss " in line and "held out: l2" in line and "top-1" in line for line in epochs)
    assert lines[0].startswith("training 4 epochs of")

    # 150 epochs of one step: without the clock only validations and every tenth; with it, more
    lines.clear()
    long = AlignConfig(hidden=[8], epochs=150, warmup_epochs=1, batch_size=256, min_steps=0, validation_fraction=0)
    train_alignment(long, old, new, labels, classifier, device=torch.device("cpu"), log=lines.append)
    quiet = [line for line in lines if line.startswith("epoch ")]
    assert len(quiet) == 15 and quiet[-1].startswith("epoch 150/150")
    lines.clear()
    monkeypatch.setattr(map_training, "PROGRESS_SECONDS", 0.0)
    train_alignment(long, old, new, labels, classifier, device=torch.device("cpu"), log=lines.append)
    assert len([line for line in lines if line.startswith("epoch ")]) == 150


def test_the_progress_bar_is_on_by_default_on_a_terminal():
    import io

    from fastfill.cli.upgrade_progress import progress_wanted

    main, side = os.openpty()  # a real terminal device
    try:
        with os.fdopen(side, "w", closefd=False) as terminal:
            assert terminal.isatty()
            assert progress_wanted(None, terminal) is True
            assert progress_wanted(False, terminal) is False
    finally:
        os.close(main)
        os.close(side)
    assert progress_wanted(None, io.StringIO()) is False  # piped, a file, a CI log
    assert progress_wanted(True, io.StringIO()) is True


def test_overrides_by_dotted_key_are_checked_like_params_yaml(tmp_path):
    from fastfill.components.platform.config import ConfigError, parse_params
    from fastfill.flows.parameters import apply_overrides, resolve_params
    from testkit.tiny_demo import tiny_params

    params = parse_params(tiny_params(tmp_path))
    changed = apply_overrides(params, {"gallery.upgrade.chunk_size": 4, "gallery.upgrade.order": "random"})
    assert changed.gallery.upgrade.chunk_size == 4 and changed.gallery.upgrade.order == "random"
    assert changed.mlflow == params.mlflow
    with pytest.raises(ConfigError, match="gallery.upgrade.chunk_size"):
        apply_overrides(params, {"gallery.upgrade.chunk_size": -1})
    with pytest.raises(ConfigError, match="no section 'nowhere'"):
        apply_overrides(params, {"nowhere.chunk_size": 1})
    import yaml

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tiny_params(tmp_path)))
    assert resolve_params(None, str(path), {"gallery.upgrade.chunk_size": 3}).gallery.upgrade.chunk_size == 3
    assert resolve_params(params, None, None) is params
