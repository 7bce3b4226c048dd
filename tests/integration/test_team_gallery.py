"""A retrieval team's own gallery: a registry with its two versions and no map joining them, PNG
files adopted in place without labels, and none of the pipeline's files on the host."""

import numpy as np
import pytest
import yaml

from fastfill.components.gallery.layouts.catalog import PartsGallery
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import planning
from tests.integration.helpers import registry_models, split_images


def _photos(folder, images) -> list[str]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, image in enumerate(images):
        names.append(f"item-{i:05d}.png")
        Image.fromarray(image[0], mode="L").save(folder / names[-1])
    return names


def test_an_unlabeled_gallery_on_a_host_without_splits(upgrade_env, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.components.experiment.inference import embed
    from fastfill.components.platform.config import parse_params
    from fastfill.flows.upgrade import upgrade_flow

    base, tmp_path = upgrade_env
    client, old_model, new_model, old_version, new_version = registry_models(base)
    client.delete_registered_model(base.mlflow.alignment_model)  # no map joins the two versions
    split = split_images(base)  # the images the team has; their labels stay here
    n = len(split.labels)
    names = _photos(tmp_path / "photos", split.images)
    (tmp_path / "photos" / "items.csv").write_text("id,uri\n" + "".join(f"{500 + i},{name}\n" for i, name in
                                                                        enumerate(names)))
    data = base.model_dump(mode="json")
    data["paths"]["data"] = str(tmp_path / "no-pipeline-here")  # no prepared split on this host
    data["gallery"]["upgrade"].update(map_pairs="gallery", map_sample=48, chunk_size=64)
    data["align"]["fastfill"]["validation_fraction"] = 0.5  # 24 held-out pairs of this tiny sample for the check
    data["promotion"]["gate"] = True
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    team = parse_params(data)
    uri = str(tmp_path / "adopted")
    runner = CliRunner()
    common = ["--store", uri, "--params", str(tmp_path / "params.yaml")]

    adopted = runner.invoke(app, ["gallery", "adopt", "--manifest", str(tmp_path / "photos" / "items.csv"), *common])
    assert adopted.exit_code == 0, adopted.output
    assert "has no label column and gallery.upgrade.judgments is not set" in adopted.output

    # under the gate there is nothing to measure the upgrade against: refused in one line, before any work
    store = open_store(uri)
    before = set(store.list(""))
    refused = runner.invoke(app, ["upgrade", *common, "--no-progress"])
    assert refused.exit_code == 6, refused.output
    assert "has no labels and no judged queries" in refused.output and "--no-gate" in refused.output
    assert "Traceback" not in refused.output
    assert set(store.list("")) == before
    dry = runner.invoke(app, ["upgrade", *common, "--dry-run"])
    assert dry.exit_code == 0 and "would be refused before planning" in dry.output, dry.output

    # ungated: the map trains on 48 of the gallery's own items, checked on held-out items of the same sample;
    # their new features are the first backfilled chunks, and the budget ends the backfill exactly
    paused = upgrade_flow(team, uri, budget=64, gate=False)
    assert paused.state == "paused" and paused.items_done == 64  # a chunk of 64 cut at 64
    plan = planning.load_plan(store, paused.upgrade_id)
    # the map sample and the (unlabeled) evaluation sample, embedded while planning
    assert 48 <= plan.prefilled < 64 and plan.eval_queries == 24
    assert [plan.chunk_bounds(c) for c in range(plan.num_chunks)] == [(0, plan.prefilled), (plan.prefilled, 64),
                                                                       (64, 72)]
    # no labels, no judgments: the advisor predicts the label-free agreement with the finished upgrade
    advice = store.get_json(f"upgrades/{plan.upgrade_id}/advice.json")
    assert advice["metric"] == "agreement" and advice["agreement"][-1] == pytest.approx(1.0)
    assert all(0 <= a <= 1 for a in advice["agreement"]) and advice["agreement"][0] < 1
    versions = client.search_model_versions(f"name = '{base.mlflow.alignment_model}'")
    trained = min(versions, key=lambda v: int(v.version))
    assert trained.tags["pairs"] == f"gallery {uri}" and trained.tags["pairs.count"] == "48"
    assert trained.tags["disc_targets"] == "the new model's predicted classes"
    assert trained.tags["check.source"] == f"gallery {uri}" and trained.tags["check"] in ("passed", "fallback",
                                                                                          "warned")
    gallery = PartsGallery(store)
    sampled = planning.order_of(store, plan.upgrade_id)[:48]
    from fastfill.components.gallery.upgrade.backfill import mixed_features

    mixed, backfilled = mixed_features(gallery, plan)
    assert backfilled.sum() == 64 and backfilled[sampled].all()
    np.testing.assert_allclose(mixed[sampled], embed(new_model, split.images[sampled]), rtol=1e-5, atol=1e-5)

    done = upgrade_flow(team, uri, gate=False)
    assert done.state == "complete" and done.items_done == n
    gallery.manifest(refresh=True)
    assert gallery.model.version == new_version
    np.testing.assert_allclose(gallery.all_features(gallery.model), embed(new_model, split.images), rtol=1e-5,
                               atol=1e-5)
    run = client.get_run(plan.mlflow_run_id)
    assert run.data.tags["check.source"] == f"gallery {uri}"


def test_a_map_checked_on_this_gallery_is_used_as_it_is(upgrade_env, prefect_harness):
    """The pipeline's map was checked on its split: on this gallery's pairs it is checked once;
    planned again (after an abort), the upgrade uses the map that check left without embedding a
    map sample, the dry run predicts from that very version, and --recheck checks it again."""
    from fastfill.cli.upgrade_commands import estimate_upgrade
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.undo import abort_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    client, *_ = registry_models(params)

    align = {**params.align, "fastfill": params.align["fastfill"].model_copy(update={"validation_fraction": 0.5})}

    def configured(**changes):
        return params.model_copy(update={"align": align, "gallery": params.gallery.model_copy(update={
            "upgrade": params.gallery.upgrade.model_copy(update={"map_pairs": "gallery", "map_sample": 48,
                                                                 "map_sample_min": 0, **changes})})})

    on_gallery = configured()
    uri = str(tmp_path / "g")
    ingest_flow(on_gallery, uri)
    assert "has not passed its check on gallery" in estimate_upgrade(on_gallery, uri).advice.note
    # a planning killed after it wrote its first chunks, before its plan: nothing of it may count as done
    from fastfill.components.platform.registry import ModelRef

    _, _, _, old_version, new_version = registry_models(params)
    uid = planning.upgrade_id(ModelRef("embedder", old_version), ModelRef("embedder", new_version))
    store = open_store(uri)
    store.put_array(planning.chunk_key(uid, 7), np.zeros((3, 16), dtype=np.float32))
    store.put_json(planning.marker_key(uid, 7), {"chunk": 7, "start": 0, "stop": 3, "count": 3})
    first = upgrade_flow(on_gallery, uri, budget=60)
    plan = planning.load_plan(store, first.upgrade_id)
    marker = planning.marker_key(uid, 7)
    assert plan.upgrade_id == uid and (not store.exists(marker) or store.get_json(marker)["count"] != 3)
    tags = client.get_run(plan.mlflow_run_id).data.tags
    assert tags["check.source"] == f"gallery {uri}" and plan.prefilled >= 48
    # the reference is the pipeline's FCT map, trained on the same pairs as the checked map: none trained here
    fct = [v for v in client.search_model_versions(f"name = '{params.mlflow.alignment_model}'")
           if v.tags.get("method") == "fct" and "pairs" not in v.tags]
    assert tags["check.reference"] in {f"models:/{params.mlflow.alignment_model}/{v.version}" for v in fct}, tags
    used = tags["map_version"]
    assert plan.map_uri.endswith(f"/{used}")
    registered = len(client.search_model_versions(f"name = '{params.mlflow.alignment_model}'"))

    abort_flow(on_gallery, uri)
    predicted = estimate_upgrade(on_gallery, uri).advice
    assert predicted.map_version == used  # the dry run predicts from the map the upgrade will use
    again = upgrade_flow(on_gallery, uri, budget=60)
    replanned = planning.load_plan(store, again.upgrade_id)
    tags = client.get_run(replanned.mlflow_run_id).data.tags
    assert replanned.map_uri == plan.map_uri and tags["map_version"] == used
    assert tags["check"].startswith("not repeated") and "check.source" not in tags
    assert replanned.prefilled == replanned.eval_queries == 24  # only the evaluation sample was embedded
    assert len(client.search_model_versions(f"name = '{params.mlflow.alignment_model}'")) == registered

    abort_flow(on_gallery, uri)
    rechecked = upgrade_flow(configured(recheck=True), uri, budget=60)
    tags = client.get_run(planning.load_plan(store, rechecked.upgrade_id).mlflow_run_id).data.tags
    assert tags["check.source"] == f"gallery {uri}"


def test_judged_queries_gate_an_unlabeled_gallery(upgrade_env, prefect_harness):
    """No labels, a judgments file (query ids and their relevant ids): the gate measures the judged
    queries against the whole gallery along the backfill, and the judged items are embedded once."""
    import pyarrow as pa

    from fastfill.components.experiment.inference import embed
    from fastfill.components.gallery.inputs.adopt import adopt
    from fastfill.components.platform.registry import ModelRef
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    _, old_model, _, old_version, _ = registry_models(params)
    split = split_images(params)
    n = len(split.labels)
    names = _photos(tmp_path / "photos", split.images)
    uri = str(tmp_path / "judged")
    table = pa.table({"id": np.arange(100, 100 + n), "uri": [str(tmp_path / "photos" / name) for name in names]})
    adopt(open_store(uri), table, ModelRef("embedder", old_version, old_model.embedding_dim), split.images.shape[1:],
          features=iter([embed(old_model, split.images)]), part_size=20)
    queries = np.arange(0, n, 6)  # 12 judged queries, each with every other item of its class relevant
    rows = [(100 + q, 100 + r) for q in queries for r in np.flatnonzero(split.labels == split.labels[q]) if r != q]
    (tmp_path / "judged.csv").write_text("query,relevant\n" + "".join(f"{q},{r}\n" for q, r in rows))
    judged = params.model_copy(update={
        "promotion": params.promotion.model_copy(update={"gate": True, "min_top1_auc_gain": -1.0, "max_nfr1": 1.0,
                                                         "max_fraction_to_gain": 1.0}),
        "gallery": params.gallery.model_copy(update={"upgrade": params.gallery.upgrade.model_copy(update={
            "judgments": str(tmp_path / "judged.csv")})})})
    # before it: which way reaches a top-1 first, on the judged queries (the gallery has no labels)
    from fastfill.cli.upgrade_commands import estimate_upgrade

    dry = estimate_upgrade(judged, uri, "", 0.5).advice.to_dict()
    target = dry.get("target") or {}
    assert target.get("truth") == "judgments", dry
    by = {way["way"]: way for way in target["ways"]}
    assert {"map, random order", "shadow index (rrf), random order"} <= set(by)
    own = by[f"map, {dry['order']} order"]  # the configured way is the prediction the dry run shows
    assert own["top1_at_0"] == pytest.approx(dry["top1"][0], abs=1e-9)
    assert own["top1_full"] == pytest.approx(dry["top1"][-1], abs=1e-9)
    assert target["line"].endswith(f"(on {dry['queries']} judged queries against {dry['sample']} sampled items)")
    result = upgrade_flow(judged, uri)
    assert result.state in ("complete", "rejected"), result
    numbers = result.promotion.numbers
    assert numbers["queries"] == len(queries) and len(numbers["top1"]) == len(numbers["alpha"]) == 22
    assert 0 <= numbers["champion_top1"] <= 1 and len(numbers["map"]) == 22
    plan = planning.load_plan(open_store(uri), result.upgrade_id)
    front = set(planning.order_of(open_store(uri), plan.upgrade_id)[:plan.prefilled].tolist())
    assert set(queries.tolist()) <= front  # the judged items, embedded once, backfilled from the start
    # the advisor predicted the curve with the gate's protocol: the judged queries against the sample
    advice = open_store(uri).get_json(f"upgrades/{plan.upgrade_id}/advice.json")
    assert advice["truth"] == "judgments" and len(advice["top1"]) == 21 and advice["queries"] >= 2
    assert all(0 <= v <= 1 for v in advice["top1"] + advice["map"])


def test_an_upgrade_completes_on_the_fallback_when_its_map_diverged(upgrade_env, prefect_harness):
    """The registry's map for the two versions gives non-finite outputs (a training that
    diverged): the upgrade's check never uses it; the l2-only map takes its place, with the
    reason on the version and the run, and the upgrade completes."""
    import torch

    from fastfill.components.model_store import registered
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    client, _, _, old_version, new_version = registry_models(params)
    name = params.mlflow.alignment_model
    found = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get("method") == "fastfill"]
    source = max(found, key=lambda v: int(v.version))
    broken = registered.load_model(f"models:/{name}/{source.version}")
    with torch.no_grad():
        for parameter in broken.transform.parameters():
            parameter.fill_(float("nan"))
    client.delete_registered_model(name)  # the broken map is the only one joining the versions
    run = client.create_run(client.get_experiment_by_name(params.mlflow.experiment).experiment_id)
    version = registered.register_alignment(client, run.info.run_id, broken, np.zeros((2, broken.old_dim), np.float32),
                                            name, {"method": "fastfill", "from_version": old_version,
                                                   "to_version": new_version, "registered_model": "embedder"})
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    result = upgrade_flow(params, uri)
    assert result.state == "complete", result
    tags = client.get_model_version(name, version).tags
    assert tags["check"] == "fallback" and "non-finite" in tags["check_reason"]
    plan = planning.load_plan(open_store(uri), result.upgrade_id)
    assert plan.map_uri != f"models:/{name}/{version}"
    assert client.get_run(plan.mlflow_run_id).data.tags["check"] == "fallback"
    gallery = PartsGallery(open_store(uri))
    assert np.isfinite(gallery.all_features(gallery.model)).all()


def test_a_bad_judgments_file_is_refused_in_one_line_before_any_work(upgrade_env, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.flows.ingest import ingest_flow

    params, tmp_path = upgrade_env
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    (tmp_path / "judged.csv").write_text("query,relevant\n0,1\n0,99999\n")
    runner = CliRunner()
    result = runner.invoke(app, ["upgrade", "--store", uri, "--params", str(tmp_path / "params.yaml"), "--no-progress",
                                 "--judgments", str(tmp_path / "judged.csv")])
    assert result.exit_code == 6 and "99999" in result.output and "Traceback" not in result.output, result.output
    assert open_store(uri).list("upgrades/") == []  # nothing planned


def test_a_gallery_too_small_for_a_checked_map_upgrades_with_the_l2_map(upgrade_env, prefect_harness, tmp_path):
    """50 items, fewer than the 195 pairs that train and check a FastFill map with the default
    validation_fraction: the dry run says so first, and the upgrade trains the l2-only map (which
    needs no check) on every item instead of refusing with a setting it cannot reach."""
    from fastfill.cli.upgrade_commands import estimate_upgrade
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, _ = upgrade_env
    client, *_ = registry_models(params)
    client.delete_registered_model(params.mlflow.alignment_model)  # no map joins the two versions
    split = split_images(params)
    np.save(tmp_path / "images.npy", split.images[:50])
    np.save(tmp_path / "labels.npy", split.labels[:50])
    align = {**params.align, "fastfill": params.align["fastfill"].model_copy(update={"validation_fraction": 0.1})}
    small = params.model_copy(update={"align": align, "gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"map_pairs": "gallery", "map_sample": 5000,
                                                             "order": "sigma"})})})
    uri = str(tmp_path / "small")
    ingest_flow(small, uri, images=tmp_path / "images.npy", labels=tmp_path / "labels.npy")

    dry = estimate_upgrade(small, uri)
    assert dry.small_gallery.startswith("the gallery has 50 items, fewer than the 195 that train and check a "
                                           "fastfill map"), dry
    done = upgrade_flow(small, uri, gate=False)
    assert done.state == "complete" and done.items_done == 50, done
    versions = client.search_model_versions(f"name = '{params.mlflow.alignment_model}'")
    assert [v.tags["method"] for v in versions] == ["fct"]
    plan = planning.load_plan(open_store(uri), done.upgrade_id)
    assert plan.order_kind == "random"


def test_a_map_sample_of_the_whole_gallery_makes_the_upgrade_a_re_embed(upgrade_env, prefect_harness, tmp_path):
    """Large enough for a checked FastFill map, but the default map sample (5,000) holds every
    item: the dry run says first that the upgrade is a re-embed, and the upgrade embeds every item
    while planning, trains no FastFill map and runs no check."""
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.cli.upgrade_commands import estimate_upgrade
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, _ = upgrade_env
    client, *_ = registry_models(params)
    client.delete_registered_model(params.mlflow.alignment_model)  # no map joins the two versions
    split = split_images(params)
    n = len(split.labels)
    np.save(tmp_path / "images.npy", split.images)
    np.save(tmp_path / "labels.npy", split.labels)
    align = {**params.align, "fastfill": params.align["fastfill"].model_copy(update={"validation_fraction": 0.5})}
    team = params.model_copy(update={"align": align, "gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"map_pairs": "gallery", "order": "sigma"})})})
    assert n >= 8 and team.gallery.upgrade.map_sample >= n  # checkable (4 held out), and the sample is all of it
    uri = str(tmp_path / "whole")
    ingest_flow(team, uri, images=tmp_path / "images.npy", labels=tmp_path / "labels.npy")

    dry = estimate_upgrade(team, uri)
    assert dry.small_gallery.startswith(f"the map sample would hold {n:,} of the gallery's {n:,} items (100%"), dry
    (tmp_path / "team.yaml").write_text(yaml.safe_dump(team.model_dump(mode="json")))
    said = CliRunner().invoke(app, ["upgrade", "--dry-run", "--store", uri, "--params", str(tmp_path / "team.yaml")])
    assert said.exit_code == 0, said.output
    assert said.output.splitlines()[1].startswith("  re-embed: the map sample would hold"), said.output

    done = upgrade_flow(team, uri, gate=False)
    assert done.state == "complete" and done.items_done == n, done
    versions = client.search_model_versions(f"name = '{params.mlflow.alignment_model}'")
    assert [v.tags["method"] for v in versions] == ["fct"]  # no FastFill map
    assert all(not v.tags.get("check", "").startswith(("passed", "fallback", "failed")) for v in versions)
    plan = planning.load_plan(open_store(uri), done.upgrade_id)
    assert plan.order_kind == "random" and plan.prefilled == n  # every item embedded while planning
