"""What happens after and between backfills: the promotion gate (promote or reject) and a third
model arriving before the second one's backfill has finished."""

import copy

import numpy as np
import pytest

from fastfill.components.gallery.layouts.catalog import GalleryError, PartsGallery
from fastfill.components.gallery.search.index import GallerySearch
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import backfill, ending, garbage, planning
from fastfill.components.gallery.upgrade.status import gallery_status
from fastfill.components.platform.config import parse_params
from fastfill.components.platform.registry import ModelRef
from tests.integration.helpers import registry_models, run_then, split_images

pytestmark = pytest.mark.slow  # minutes on 2 cores; `-m 'not slow'` skips them


def _with(params, **sections):
    data = params.model_dump(mode="json")
    for name, values in sections.items():
        data[name] = {**data[name], **values}
    return parse_params(data)


def _register(params, model, tags):
    """A further embedder version (no alias), as a platform team would register one."""
    import torch

    from fastfill.components.model_store import registered
    from fastfill.components.platform import registry

    client, experiment = registry.setup(params.mlflow)
    run = client.create_run(experiment, run_name="register")
    example = np.zeros((1, model.in_channels, 16, 16), np.float32)
    with torch.no_grad():
        version = registered.register_embedder(client, run.info.run_id, model.eval(), example,
                                             params.mlflow.registered_model, None, tags)
    return client, str(version)


def _random_model(model, seed):
    """Same architecture, untrained: a model that knows nothing."""
    import torch

    from fastfill.components.experiment.models import Embedder
    from fastfill.components.platform.config import TrainConfig

    torch.manual_seed(seed)
    config = TrainConfig(backbone="cnn", width=4, embedding_dim=16)
    fresh = Embedder(config, model.in_channels, model.classes.tolist(), float(model.pixel_mean), float(model.pixel_std))
    return fresh.eval()


def _perturbed(model, seed, scale=0.05):
    """A slightly different model of the same space (a third version for sequential upgrades)."""
    import torch

    variant = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in variant.embedding.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.abs().mean())
    return variant.eval()


def test_the_gate_promotes_a_better_model_and_records_why(upgrade_env, prefect_harness):
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    # tiny models on tiny data: loose gates, so this checks the mechanism (the unit tests check the rules)
    params = _with(params, promotion={"gate": True, "min_top1_auc_gain": -1.0, "max_nfr1": 1.0, "max_relative_nfr1": 10.0,
                                      "max_fraction_to_gain": 1.0})
    client, _, _, old_version, new_version = registry_models(params)
    uri = str(tmp_path / "gallery")
    ingest_flow(params, uri)
    result = upgrade_flow(params, uri)
    numbers = result.promotion.numbers
    assert result.state == "complete" and result.promotion.passed, result.promotion
    name = params.mlflow.registered_model
    assert str(client.get_model_version_by_alias(name, "champion").version) == new_version
    tags = client.get_model_version(name, new_version).tags
    assert tags["promotion"] == "passed" and tags["promotion.champion_version"] == old_version
    assert float(tags["promotion.top1_auc"]) == pytest.approx(numbers["top1_auc"], abs=1e-6)
    run = client.get_run(result.mlflow_run_id)
    assert run.data.tags["promotion"] == "passed"
    assert run.data.metrics["gate.top1_auc_gain"] == pytest.approx(numbers["top1_auc_gain"])
    assert len(client.get_metric_history(run.info.run_id, "gate.top1")) == params.promotion.curve_points + 2
    assert PartsGallery(open_store(uri)).model.version == new_version


def test_the_gate_rejects_a_worse_model_and_the_gallery_keeps_the_champion(upgrade_env, prefect_harness):
    from fastfill.components.experiment.inference import embed
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    # the default gates, measured on every item (a 24-item sample is too noisy to be sure which gate fails)
    params = _with(params, promotion={"gate": True},
                   gallery={"upgrade": {**params.gallery.upgrade.model_dump(mode="json"), "eval_queries": "all"}})
    client, old_model, new_model, old_version, _ = registry_models(params)
    _, worse = _register(params, _random_model(new_model, seed=3), {"role": "new"})
    uri = str(tmp_path / "gallery")
    ingest_flow(params, uri)
    store = open_store(uri)
    before = {key: store.get(key) for key in store.list("features/")}

    result = upgrade_flow(params, uri, f"models:/embedder/{worse}")
    assert result.state == "rejected" and not result.promotion.passed
    reasons = result.promotion.reasons
    assert any("below the minimum" in r for r in reasons), reasons
    name = params.mlflow.registered_model
    assert str(client.get_model_version_by_alias(name, "champion").version) == old_version
    tags = client.get_model_version(name, worse).tags
    assert tags["promotion"] == "rejected" and "below the minimum" in tags["promotion.reason"]
    assert client.get_run(result.mlflow_run_id).data.tags["promotion"] == "rejected"

    # the gallery serves the champion's features: no upgrade, old model, features untouched
    gallery = PartsGallery(store)
    assert gallery.manifest(refresh=True)["upgrade"] is None and gallery.model.version == old_version
    assert {key: store.get(key) for key in store.list("features/")} == before
    searcher = GallerySearch(gallery)
    assert searcher.query_model.version == old_version and searcher.upgrade_id is None
    split = split_images(params)
    ids, _ = searcher.search(embed(old_model, split.images[:4]), k=1)
    assert list(ids[:, 0]) == [0, 1, 2, 3]  # each item finds itself among the champion's features
    assert gallery_status(gallery).state == "idle"

    with pytest.raises(GalleryError, match="rejected by the promotion gate"):
        upgrade_flow(params, uri, f"models:/embedder/{worse}")
    deleted = garbage.collect_garbage(gallery)
    assert deleted["upgrade_objects"] > 0 and store.exists(planning.upgrade_key(result.upgrade_id, "rejected.json"))


def test_a_third_model_arrives_mid_backfill(upgrade_env, prefect_harness):
    """v1 -> v2 stopped half-way, then v3: the gallery holds features of three versions, queries
    work through the composed maps, the new order covers every item, and it completes."""
    from fastfill.components.evaluation import pairwise_distances
    from fastfill.components.experiment.inference import embed
    from fastfill.components.model_store import registered
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    client, _, new_model, v1, v2 = registry_models(params)
    _, v3 = _register(params, _perturbed(new_model, seed=5), {"role": "new"})
    uri = str(tmp_path / "gallery")
    ingest_flow(params, uri)
    first = upgrade_flow(params, uri, f"models:/embedder/{v2}", budget=0.5)
    assert first.state == "paused" and 0.4 < first.fraction < 0.7
    store = open_store(uri)
    gallery = PartsGallery(store)
    plan1 = planning.load_plan(store, first.upgrade_id)
    mixed1, backfilled1 = backfill.mixed_features(gallery, plan1)
    assert 0 < backfilled1.sum() < len(backfilled1)

    second = upgrade_flow(params, uri, f"models:/embedder/{v3}", budget=0.3)
    assert second.state == "paused"
    plan2 = planning.load_plan(store, second.upgrade_id)
    assert plan2.base == plan1.upgrade_id and plan2.old.version == v2 and plan2.new.version == v3
    assert gallery.manifest(refresh=True)["upgrade"] == plan2.upgrade_id
    assert store.get_json(planning.upgrade_key(plan1.upgrade_id, "superseded.json"))["by"] == plan2.upgrade_id
    # three versions stored: v1's features, v2's backfilled chunks, v3's backfilled chunks
    assert store.list(f"features/embedder-v{v1}/")
    assert backfill.done_chunks(store, plan1.upgrade_id) and backfill.done_chunks(store, plan2.upgrade_id)
    # the sequential upgrade starts from v2's mixed gallery, and its order covers every item
    sources = np.concatenate([store.get_array(planning.source_key(plan2.upgrade_id, p)) for p in range(gallery.num_parts)])
    np.testing.assert_array_equal(sources, mixed1)
    assert sorted(planning.order_of(store, plan2.upgrade_id).tolist()) == list(range(gallery.num_items))

    # queries use v3 against the gallery as it stands, and match a brute-force search
    searcher = GallerySearch(gallery)
    assert searcher.query_model.version == v3
    v3_model_loaded = registered.load_model(f"models:/embedder/{v3}")
    queries = embed(v3_model_loaded, split_images(params).images[:6])
    mixed2, backfilled2 = backfill.mixed_features(gallery, plan2)
    assert backfilled2.sum() == second.items_done
    ids, _ = searcher.search(queries, k=3)
    expected = np.argsort(pairwise_distances(queries, mixed2), axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.sort(gallery.ids()[expected], axis=1))
    # the curve of the sequential upgrade is measured along the way
    assert client.get_metric_history(plan2.mlflow_run_id, "top1")

    done = upgrade_flow(params, uri, f"models:/embedder/{v3}")
    gallery = PartsGallery(store)
    assert done.state == "complete" and gallery.model.version == v3
    features = gallery.all_features(gallery.model)
    np.testing.assert_allclose(features, embed(v3_model_loaded, split_images(params).images), atol=1e-5)
    garbage.collect_garbage(gallery)
    assert not store.list(f"features/embedder-v{v1}/") and not store.list(planning.upgrade_key(plan1.upgrade_id, "done/"))


def _ready_to_end(params, tmp_path, monkeypatch):
    """A gallery whose backfill is complete and whose ending has not started (the ending failed
    once at its very start), as a folder to copy for each scenario."""
    import fastfill.flows.upgrade as fu
    from fastfill.components.gallery.upgrade.run import UpgradeRun
    from fastfill.flows.ingest import ingest_flow

    uri = str(tmp_path / "ready")
    ingest_flow(params, uri)

    def not_yet(*args, **kwargs):
        raise RuntimeError("stop before the ending")

    with monkeypatch.context() as patch:
        patch.setattr(UpgradeRun, "_end", not_yet)
        with pytest.raises(RuntimeError, match="stop before the ending"):
            fu.upgrade_flow(params, uri)
    return uri


def _failing_after(monkeypatch, owner, name, step):
    original = getattr(owner, name)

    def run_then_fail(*args, **kwargs):
        original(*args, **kwargs)
        raise RuntimeError(f"injected after {step}")

    monkeypatch.setattr(owner, name, run_then_fail)


@pytest.mark.parametrize("passes", [True, False], ids=["promotion", "rejection"])
def test_an_ending_interrupted_after_any_step_is_completed_by_the_next_run(upgrade_env, prefect_harness,
                                                                          monkeypatch, passes):
    import shutil

    import fastfill.flows.upgrade as fu
    import fastfill.tasks.gallery_store as store_tasks
    from fastfill.components.gallery.store.lock import LOCK

    params, tmp_path = upgrade_env
    gain = -1.0 if passes else 1.0  # a gate every challenger passes, or one none can
    params = _with(params, promotion={"gate": True, "min_top1_auc_gain": gain, "max_nfr1": 1.0, "max_relative_nfr1": 10.0,
                                      "max_fraction_to_gain": 1.0})
    client, _, _, old_version, new_version = registry_models(params)
    name = params.mlflow.registered_model
    ready = _ready_to_end(params, tmp_path, monkeypatch)
    steps = [("decision", ending, "write_decision"),
             ("switch", store_tasks, "finish_upgrade" if passes else "reject_upgrade"),
             ("registry", fu, "follow_decision")]  # after the last step (marking it recorded) it is over
    for step, owner, function in steps:
        client.set_registered_model_alias(name, "champion", old_version)  # the registry as before the ending
        for key in [k for k in client.get_model_version(name, new_version).tags if k.startswith("promotion")]:
            client.delete_model_version_tag(name, new_version, key)
        uri = str(tmp_path / f"g-{step}")
        shutil.copytree(ready, uri, symlinks=True)  # the local store keeps each key as a link to its object file
        with monkeypatch.context() as patch:
            _failing_after(patch, owner, function, step)
            with pytest.raises(RuntimeError, match=f"injected after {step}"):
                fu.upgrade_flow(params, uri)
        gallery = PartsGallery(open_store(uri))
        assert gallery_status(gallery).state == "ending interrupted", step

        result = fu.upgrade_flow(params, uri)  # the same command again

        assert result.state == ("complete" if passes else "rejected"), step
        expected = new_version if passes else old_version
        assert gallery.manifest(refresh=True)["upgrade"] is None and gallery.model.version == expected, step
        assert str(client.get_model_version_by_alias(name, "champion").version) == expected, step
        assert client.get_model_version(name, new_version).tags["promotion"] == ("passed" if passes else "rejected")
        uid = planning.upgrade_id(ModelRef(name, old_version), ModelRef(name, new_version))
        assert ending.decision(gallery.store, uid).registry_recorded, step
        assert not gallery.store.exists(LOCK) and gallery_status(gallery).state == "idle", step
        assert gallery.store.exists(planning.upgrade_key(uid, "rejected.json")) == (not passes), step
        if passes:  # once more: nothing to upgrade, and a success
            assert fu.upgrade_flow(params, uri).state == "up-to-date"
        else:
            with pytest.raises(GalleryError, match="rejected by the promotion gate"):
                fu.upgrade_flow(params, uri)


@pytest.mark.parametrize("offset", ["read-before-lock", "after-decision", "after-switch", "after-registry",
                                    "after-finish"])
def test_a_second_upgrade_at_any_offset_around_the_first_s_finish_never_runs_it_again(
        upgrade_env, prefect_harness, monkeypatch, offset):
    """Two upgrades to the same challenger, the second started at several moments around the
    first one's finish (injected at each step of the ending). Exactly one upgrade runs; the second
    decides from the gallery's state under the lock: it finds the upgrade done (nothing to
    upgrade, a success), or is refused while the first holds the lock, naming it. It never
    judges the new champion against itself: the gallery, champion, the version's tags and the
    rejection records agree."""
    import shutil

    import fastfill.flows.upgrade as fu
    import fastfill.tasks.gallery_store as store_tasks
    from fastfill.components.gallery.store.lock import LOCK, UpgradeLocked

    params, tmp_path = upgrade_env
    params = _with(params, promotion={"gate": True, "min_top1_auc_gain": -1.0, "max_nfr1": 1.0, "max_relative_nfr1": 10.0,
                                      "max_fraction_to_gain": 1.0})
    client, _, _, old_version, new_version = registry_models(params)
    name = params.mlflow.registered_model
    uri = str(tmp_path / "gallery")
    shutil.copytree(_ready_to_end(params, tmp_path, monkeypatch), uri, symlinks=True)
    second = {}

    def start_the_second():
        if second:
            return
        try:
            second["result"] = fu.upgrade_flow(params, uri)
        except UpgradeLocked as error:
            second["refused"] = str(error)

    if offset == "read-before-lock":  # the second read the registry and the gallery before the first began
        real_acquire = fu.acquire_lock

        def the_first_finishes_meanwhile(*args, **kwargs):
            if not second:
                with monkeypatch.context() as patch:
                    patch.setattr(fu, "acquire_lock", real_acquire)
                    second["first"] = fu.upgrade_flow(params, uri)
            return real_acquire(*args, **kwargs)

        monkeypatch.setattr(fu, "acquire_lock", the_first_finishes_meanwhile)
        second["result"] = fu.upgrade_flow(params, uri)
        first = second.pop("first")
    else:
        steps = {"after-decision": (ending, "write_decision"), "after-switch": (store_tasks, "finish_upgrade"),
                 "after-registry": (fu, "follow_decision")}
        if offset in steps:
            owner, function = steps[offset]
            monkeypatch.setattr(owner, function, run_then(owner, function, start_the_second))
        first = fu.upgrade_flow(params, uri)
        monkeypatch.undo()
        start_the_second()  # after-finish: the first has returned; for the others a no-op

    assert first.state == "complete"
    if offset in ("read-before-lock", "after-finish"):
        assert second["result"].state == "up-to-date", second
        if offset == "after-finish":  # the promotion cleared `challenger`: nothing names a model to upgrade to
            assert "has no `challenger`" in second["result"].message, second
    else:  # the first still holds the lock: refused, naming the holder, having changed nothing
        assert "is being upgraded" in second["refused"] and "by process" in second["refused"], second
    assert str(client.get_model_version_by_alias(name, "champion").version) == new_version
    assert client.get_model_version(name, new_version).tags["promotion"] == "passed"
    assert registry_alias(client, name, "challenger") is None  # cleared by the promotion
    store = open_store(uri)
    gallery = PartsGallery(store)
    assert gallery.model.version == new_version and gallery.manifest()["upgrade"] is None
    assert not [key for key in store.list("upgrades/") if key.endswith("rejected.json")]
    assert not store.exists(LOCK) and gallery_status(gallery).state == "idle"
    uid = planning.upgrade_id(ModelRef(name, old_version), ModelRef(name, new_version))
    assert ending.decision(store, uid).registry_recorded and ending.decision(store, uid).passed
    assert fu.upgrade_flow(params, uri).state == "up-to-date"  # and once more, later: still nothing to do


def registry_alias(client, name, alias):
    from fastfill.components.platform.registry import alias_version

    return alias_version(client, name, alias)
