"""Commands of the stored gallery: ingest, adopt, info, gc, rollback, and search."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from fastfill.cli import app, json_output
from fastfill.cli.command_support import (
    USAGE,
    ParamsOption,
    StoreOption,
    call,
    fail,
    load,
    need_services,
    outcome,
    require_services,
    store_uri,
)
from fastfill.cli.json_output import JsonOption, answer, answers_json
from fastfill.components.gallery.layouts.convert import convert
from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.search.dual import DualSearch
from fastfill.components.gallery.search.served import searcher_for
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade.garbage import collect_garbage
from fastfill.components.gallery.upgrade.reversal import rollback_target
from fastfill.components.gallery.upgrade.status import gallery_status
from fastfill.components.model_store import registered
from fastfill.components.platform import registry
from fastfill.components.platform.vocabulary import SEARCH_MERGES
from fastfill.flows import undo
from fastfill.flows.ingest import _load_array, adopt_flow, adopt_table_flow, ingest_flow
from fastfill.tasks.gallery_store import open_gallery

# the choices of search --merge (mypy reads an Enum's members from a literal only)
Merge = Enum("Merge", {name: name for name in SEARCH_MERGES}, type=str)  # type: ignore[misc]

gallery_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="The stored gallery: ingest, adopt, convert, info, gc, rollback.")
app.add_typer(gallery_app, name="gallery")


def show_status(store: str | None, params: Path, schema: str | None = None) -> None:
    """The gallery's manifest and upgrade state, as JSON on stdout; with --json, the document
    ``schema`` names (gallery.info, upgrade.status)."""
    config = load(params)
    uri = store_uri(config, store)

    state = call(lambda: gallery_status(open_gallery(uri))).to_dict()
    if schema is not None:
        return answer(*json_output.status_document(schema, state))
    typer.echo(json.dumps(state, indent=2))


def run_undo(flow_name: str, store: str | None, params: Path, target) -> tuple[str, Any]:
    """Run an undoing flow of flows/undo.py (``abort_flow``, ``rollback_flow``) on the gallery,
    the services checked first: (its store's URI, the flow's result: ``reversal.AbortAnswer``, the
    rollback's dict). The flow reads the configuration file itself. ``target``
    (reversal.abortable, reversal.rollback_target) is asked first, without Prefect: with nothing to
    undo the command answers at once and starts no server (the flow asks again under the lock)."""
    config = load(params)
    uri = store_uri(config, store)

    try:
        target(gallery_at(open_store(uri)))
    except Exception as error:  # noqa: BLE001 - a known failure is one line; anything else goes on to the flow
        known = outcome(error)
        if known is None:
            raise
        fail(known[1], known[0])
    need_services(config)

    return uri, call(getattr(undo, flow_name), store_uri=uri, params_path=str(params.resolve()))


@gallery_app.command("ingest", short_help="Images into the store with the champion's features.")
def gallery_ingest(store: StoreOption = None,
                   model: Annotated[str, typer.Option(help="whose features the gallery stores; default: "
                                                     "models:/<registered_model>@champion")] = "",
                   images: Annotated[Path | None, typer.Option(help="uint8 .npy, (N, C, H, W) or (N, H, W); default: "
                                                            "the prepared test split")] = None,
                   labels: Annotated[Path | None, typer.Option(help=".npy of N integer labels")] = None,
                   groups: Annotated[Path | None, typer.Option(help=".npy of N group names or numbers")] = None,
                   ids: Annotated[Path | None, typer.Option(help=".npy of N unique integer item ids; default 0..N-1")] = None,
                   features: Annotated[Path | None, typer.Option(help=".npy of precomputed features of the model")] = None,
                   params: ParamsOption = Path("params.yaml")) -> None:
    """Put images (and labels, groups) into the store with the champion model's features."""
    config = load(params)

    uri = store_uri(config, store)
    need_services(config)
    # the flow run reads params.yaml itself: its Prefect parameters are these few values
    manifest = call(ingest_flow, store_uri=uri, model_uri=model, images=images, labels=labels, groups=groups, ids=ids,
                    features=features, params_path=str(params.resolve()))
    typer.echo(f"{uri}: {manifest['num_items']} items, model {manifest['model']['uri']}")


def _parse_shape(text: str | None) -> tuple[int, int, int] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        fail(f"--image-shape {text!r}: give channels,height,width, e.g. 1,28,28 or 3,224,224", USAGE)
    return shape


@gallery_app.command("adopt", short_help="Adopt a gallery where it is (images read by URI).")
def gallery_adopt(manifest: Annotated[str | None, typer.Option(help="CSV or Parquet (a path or s3://bucket/key): id, "
                                                        "uri (s3://bucket/key, a path, or a path under --root), "
                                                        "optional label, group and weight (how often queries hit "
                                                        "the item: the usage orders' weight)")] = None,
                  table: Annotated[str | None, typer.Option(
                      help="instead of --manifest: the team's PostgreSQL table (with pgvector), adopted where it is, "
                           "no vector copied; server, id and image columns from gallery.pgvector")] = None,
                  vector_column: Annotated[str, typer.Option(help="with --table: the column of the model's vectors")]
                  = "embedding",
                  label_column: Annotated[str | None, typer.Option(help="with --table: a column of integer labels "
                                                                   "(optional)")] = None,
                  store: StoreOption = None,
                  root: Annotated[str | None, typer.Option(help="where relative URIs live: a folder or "
                                                           "s3://bucket/prefix")] = None,
                  features: Annotated[list[str] | None, typer.Option(
                      help="the current features in the manifest's row order: .npy shards (repeat the option, in "
                           "order) or one Parquet file, paths or s3:// URIs; omitted: the model embeds the images")] = None,
                  features_column: Annotated[str, typer.Option(help="the Parquet column of the features")] = "features",
                  model: Annotated[str, typer.Option(help="the model the features come from; default: "
                                                     "models:/<registered_model>@champion")] = "",
                  image_shape: Annotated[str | None, typer.Option(help="C,H,W the model takes; default: from its "
                                                                  "registered signature")] = None,
                  params: ParamsOption = Path("params.yaml")) -> None:
    """Adopt a gallery where it is: the images are not copied, a backfill reads them by URI. With
    --table, a team's PostgreSQL table: its vectors stay in it and its service queries the view."""
    config = load(params)

    if (manifest is None) == (table is None):
        fail("give exactly one of --manifest (a file of ids and URIs) or --table (a PostgreSQL table)", USAGE)
    uri = store_uri(config, store)
    if table is not None:
        if features:
            fail("--features goes with --manifest: a --table's vectors are its --vector-column", USAGE)
        config = config.model_copy(update={"gallery": config.gallery.model_copy(update={
            "layout": "pgvector", "pgvector": config.gallery.pgvector.model_copy(update={"table": table})})})
        result = call(adopt_table_flow, config, uri, vector_column, model, label_column, root, _parse_shape(image_shape))
        index = result["index"]
        typer.echo(f"{uri}: {result['num_items']} items of table {index['table']} adopted where they are, model "
                   f"{result['model']['uri']} in column {vector_column}; point the service's queries at the view "
                   f"{index['view']} (docs/serving.md)")
        return
    result = call(adopt_flow, config, uri, manifest, model, root, features or None, features_column,
                  _parse_shape(image_shape))
    typer.echo(f"{uri}: {result['num_items']} items adopted, model {result['model']['uri']}; images read by URI")
    if not result.get("has_labels") and not config.gallery.upgrade.judgments:
        typer.echo(f"warning: {manifest} has no label column and gallery.upgrade.judgments is not set: the promotion "
                   "gate of an upgrade of this gallery needs judged queries (`fastfill upgrade --judgments FILE`), or "
                   "the upgrade runs with --no-gate", err=True)


@gallery_app.command("info", short_help="The manifest and upgrade state (JSON).")
@answers_json
def gallery_info(store: StoreOption = None, as_json: JsonOption = False,
                 params: ParamsOption = Path("params.yaml")) -> None:
    """The gallery's manifest and upgrade state, as JSON."""
    show_status(store, params, "gallery.info" if as_json else None)


@gallery_app.command("gc", short_help="Delete unused features and ended upgrades' data.")
@answers_json
def gallery_gc(store: StoreOption = None, as_json: JsonOption = False,
               params: ParamsOption = Path("params.yaml")) -> None:
    """Delete features of models the gallery no longer uses, and finished upgrades' working data."""
    config = load(params)
    uri = store_uri(config, store)

    deleted = call(lambda: collect_garbage(open_gallery(uri)))
    if as_json:
        return answer(*json_output.gc_document(uri, deleted))
    typer.echo(f"{uri}: deleted {deleted['features']} unused features (objects, or the product's tables) and "
               f"{deleted['upgrade_objects']} objects of finished upgrades")
    for column in deleted["kept_columns"]:
        typer.echo(f"kept {column}: the team's column, which no model of the gallery serves now; drop it yourself "
                   "when none of your readers uses it (the product drops nothing it did not make)")


@gallery_app.command("release", short_help="Drop the objects this gallery made in the team's database.")
@answers_json
def gallery_release(store: StoreOption = None, as_json: JsonOption = False,
                    params: ParamsOption = Path("params.yaml")) -> None:
    """Drop every object this gallery made in the team's database (the view, its bookkeeping and
    vectors tables, the ANN indexes it built: those carrying its mark), nothing else; then another
    gallery may adopt the table under the same names. Refused while an upgrade is under way."""
    config = load(params)
    uri = store_uri(config, store)
    dropped = call(lambda: open_gallery(uri).release())
    if as_json:
        return answer("fastfill.gallery.release/1", {"store": uri, "dropped": dropped})
    for line in dropped:
        typer.echo(f"dropped {line}")
    typer.echo(f"{uri}: released {len(dropped)} objects; the gallery in this store no longer serves (the team's "
               "table and its columns are as they were)")


@gallery_app.command("rollback", short_help="Undo the last finished upgrade (before gc).")
@answers_json
def gallery_rollback(store: StoreOption = None, as_json: JsonOption = False,
                     params: ParamsOption = Path("params.yaml")) -> None:
    """Undo the last finished upgrade while the old features exist (before gc): champion moves back."""
    # The gallery serves the previous model's features again, champion moves back to that
    # version (when it still names the rolled-back one), and the rolled-back version is tagged
    # promotion=rolled-back. Refused during an upgrade and once gc collected the old features.

    uri, result = run_undo("rollback_flow", store, params, rollback_target)
    if as_json:
        return answer(*json_output.undo_document("gallery.rollback", uri, result))
    typer.echo(f"{uri}: rolled back from {result['from']} to {result['model']}; "
               + ("champion moved back" if result["champion_moved"] else "champion left as it was (it no longer "
                                                                       f"named {result['from']})"))


@gallery_app.command("convert", short_help="The gallery into another layout (default: the Lance table).")
@answers_json
def gallery_convert(store: StoreOption = None,
                    to: Annotated[str | None, typer.Option(help="store URI (folder or s3://bucket/prefix) to write "
                                                          "the converted gallery to; default: the same store")] = None,
                    layout: Annotated[str, typer.Option(help="the layout to convert to: lance (gallery.lance, which "
                                                        "pyarrow, DuckDB and LanceDB open) or parts")] = "lance",
                    as_json: JsonOption = False,
                    params: ParamsOption = Path("params.yaml")) -> None:
    """Move the gallery (items, images or their URIs, the serving model's features, its history)
    into another layout, read it back and compare it with the source, then switch the manifest.
    Refused during an upgrade. In the same store the old layout's data stays until gallery gc."""
    config = load(params)

    uri = store_uri(config, store)
    result = call(lambda: convert(open_gallery(uri, config.gallery.s3), to, layout, config.gallery))
    if as_json:
        return answer(*json_output.convert_document(result))
    typer.echo(f"{result['store']}: {result['items']} items, features of {result['model']} (dimension {result['dim']}), "
               f"now in the {result['layout']} layout; read back and equal to the source"
               + ("; `fastfill gallery gc` deletes the old layout's data" if result["in_place"] else ""))


@app.command(short_help="Nearest gallery items of each query, mid-upgrade too.")
@answers_json
def search(store: StoreOption = None,
           features: Annotated[Path | None, typer.Option(help=".npy of query features (the query model's)")] = None,
           images: Annotated[Path | None, typer.Option(help=".npy of uint8 query images, embedded with the query model")] = None,
           k: Annotated[int, typer.Option("--k", "-k", help="results per query")] = 10,
           merge: Annotated[Merge | None, typer.Option(
               help="mid-upgrade, search like a shadow index: the old model's features of the items not yet "
               "re-embedded and the new model's of those that are, two lists merged (rrf, score_minmax, "
               "score_zscore); online: the new model's query alone, its reverse transformation (kept by an "
               "upgrade planned with gallery.upgrade.online) searching the old part, merged by distance; rerank: "
               "candidate reranking, the old query's top --depth items in every item's old features, those "
               "re-embedded ranked by the new query; default: one index through the map")] = None,
           depth: Annotated[int | None, typer.Option(
               help="with --merge rerank: the candidates (K) the old index returns per query; default: "
               "gallery.upgrade.rerank_depth (50)")] = None,
           old_features: Annotated[Path | None, typer.Option(
               help="with --merge and --features: .npy of the same queries' old-model features")] = None,
           as_json: JsonOption = False,
           params: ParamsOption = Path("params.yaml")) -> None:
    """Top-k item ids of each query against the gallery as it is now (mid-upgrade: the new model's
    features where backfilled, transformed old features elsewhere), and for each hit where its
    features come from (sources). JSON to stdout."""
    config = load(params)
    if (features is None) == (images is None):
        fail("give exactly one of --features or --images", USAGE)
    if old_features is not None and (merge is None or features is None or merge.value == "online"):
        fail("--old-features goes with --merge rrf/score_*/rerank and --features (with --images both models embed "
             "the queries; --merge online needs the new model's features alone)", USAGE)
    if depth is not None and (merge is None or merge.value != "rerank"):
        fail("--depth goes with --merge rerank (the candidates the old index returns per query)", USAGE)
    if depth is not None and depth < 1:
        fail(f"--depth {depth}: give the number of candidates per query, an integer >= 1", USAGE)
    uri = store_uri(config, store)
    if merge is not None:
        return _merged_search(config, uri, merge.value, features, old_features, images, k,
                              config.gallery.upgrade.rerank_depth if depth is None else depth)

    def run_search():
        searcher = searcher_for(open_gallery(uri), config.gallery.distance, config.gallery.index)
        if features is not None:
            return searcher, searcher.search(_load_array(features, "--features"), k)

        require_services(config)  # the model comes from the registry
        registry.setup(config.mlflow)
        model = registered.load_model(searcher.query_model.uri)
        return searcher, searcher.search_images(_load_array(images, "--images"), model, k)

    searcher, (ids, distances) = call(run_search)
    _answer_search("fastfill.search/1", {
        "query_model": searcher.query_model.uri, "backfilled": searcher.backfilled,
        "items": searcher.gallery.num_items, "ids": ids.tolist(), "sources": searcher.sources(ids),
        "distances": [[round(float(d), 6) for d in row] for row in distances]})


def _answer_search(schema: str, found: dict) -> None:
    """The search's answer: one line of JSON; with --json, the document ``schema`` names."""
    if json_output.json_mode():
        answer(schema, found)
    else:
        typer.echo(json.dumps(found))


def _merged_search(config, uri: str, merge: str, features: Path | None, old_features: Path | None,
                   images: Path | None, k: int, depth: int) -> None:
    """`search --merge`: the shadow index's answer, online backfilling's or candidate reranking's
    (``depth`` candidates per query) (components/gallery/search/dual.py)."""
    def run_search():
        searcher = DualSearch(open_gallery(uri), config.gallery.distance, merge, config.evaluate.rrf_k, depth)
        upgrading = searcher.new_model if searcher.mid_upgrade else None  # the upgrade's new model, when one is on
        if merge == "online" and features is not None:
            return searcher, searcher.search_online(_load_array(features, "--features"), k)
        if features is not None:
            if upgrading is not None and old_features is None:
                fail(f"an upgrade to {upgrading.uri} is on: --merge needs the queries' old-model features "
                     "too (--old-features FILE), or give --images and both models embed them", USAGE)
            new = _load_array(features, "--features")
            old = _load_array(old_features, "--old-features") if old_features is not None else new
            return searcher, searcher.search(old, new if searcher.mid_upgrade else None, k)

        require_services(config)  # the models come from the registry
        registry.setup(config.mlflow)
        online = merge == "online" and searcher.mid_upgrade  # the new model alone embeds the queries
        old_model = None if online else registered.load_model(searcher.old_model.uri)
        new_model = registered.load_model(upgrading.uri) if upgrading is not None else None
        queries = _load_array(images, "--images")
        if queries is None:  # the options' check above asks for --features or --images
            fail("give the queries: --features FILE or --images FILE", USAGE)
        return searcher, searcher.search_images(queries, old_model, new_model, k)

    searcher, (ids, scores, sources) = call(run_search)
    _answer_search("fastfill.search.merge/1", {
        "merge": merge if searcher.mid_upgrade else None,
        **({"depth": depth} if merge == "rerank" and searcher.mid_upgrade else {}),
        "query_models": [m.uri for m in ((searcher.new_model,) if merge == "online" and searcher.mid_upgrade
                                         else (searcher.old_model, searcher.new_model)) if m is not None],
        "backfilled": searcher.backfilled, "items": searcher.gallery.num_items, "ids": ids.tolist(), "sources": sources,
        ("scores" if searcher.mid_upgrade else "distances"): [[round(float(d), 6) for d in row] for row in scores]})
