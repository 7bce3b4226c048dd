"""The upgrade's cost is its backfill: its wall time against the time to embed the items it
re-embeds, measured side by side in one run.

After `fastfill run` (the registry holds the old and new models and their maps), the test split
is ingested as a gallery (a local folder), and each scenario upgrades a fresh copy of it, on a
private copy of the MLflow store:

- ``first upgrade``: the default upgrade as a user first runs it: the registry's map is checked on
  this gallery's map sample (its l2-only reference: the registry's FCT map trained on the same
  pairs), then used;
- ``checked map``: the registry's map already passed its check on this gallery (a first upgrade
  checked it, then was aborted), so the upgrade uses it as it is;
- ``splits map``: ``map_pairs: splits``, the pipeline's map checked on the split: used as it is
  (no split is read);
- ``gallery-trained map``: no map in the registry: the upgrade trains one on a gallery sample
  (``map_sample``) and checks it.

Per scenario: the upgrade's wall time, the time to embed every gallery item with the new model
(the same batch size, in this process, right before), and the difference: the fixed overhead
(planning, Prefect, MLflow, the store; and in the last scenario the map's training and check).

    .venv/bin/python benchmarks/upgrade_overhead.py

Writes reports/upgrade_overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastfill.components.platform import runtime  # noqa: E402,F401  (Prefect settings before Prefect loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--scenarios", nargs="+", default=["first upgrade", "checked map", "splits map", "gallery-trained map"])
    parser.add_argument("--out", default="reports")
    args = parser.parse_args()

    from fastfill.components.experiment.data import load_split
    from fastfill.components.experiment.inference import embed
    from fastfill.components.model_store import registered
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import load_params
    from fastfill.components.platform.layout import Layout
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.undo import abort_flow
    from fastfill.flows.upgrade import upgrade_flow

    base = load_params(args.params)
    source_db = Path(base.mlflow.tracking_uri.removeprefix("sqlite:///"))
    images = load_split(Layout(base.paths).splits, "test").images
    scratch = Path(tempfile.mkdtemp(prefix="fastfill-overhead-"))
    rows = []
    for scenario in args.scenarios:
        work = scratch / scenario.replace(" ", "-")
        work.mkdir()
        shutil.copy(source_db, work / "mlflow.db")
        data = base.model_dump(mode="json")
        data["mlflow"]["tracking_uri"] = f"sqlite:///{work / 'mlflow.db'}"
        data["gallery"]["store"] = str(work / "gallery")
        data["gallery"]["upgrade"]["map_pairs"] = "splits" if scenario == "splits map" else "gallery"
        data["promotion"]["gate"] = False
        params = type(base).model_validate(data)
        client, _ = registry.setup(params.mlflow)
        if scenario == "gallery-trained map":
            client.delete_registered_model(params.mlflow.alignment_model)
        ingest_flow(params, str(work / "gallery"))
        if scenario == "checked map":  # the first upgrade checks the registry's map on this gallery
            upgrade_flow(params, str(work / "gallery"), budget=1)
            abort_flow(params, str(work / "gallery"))
        new = client.get_model_version_by_alias(params.mlflow.registered_model, registry.CHALLENGER)
        model = registered.load_model(f"models:/{params.mlflow.registered_model}/{new.version}").eval()
        started = time.perf_counter()
        embed(model, images, batch_size=params.gallery.upgrade.batch_size, precision=params.gallery.upgrade.precision)
        embed_seconds = time.perf_counter() - started
        started = time.perf_counter()
        result = upgrade_flow(params, str(work / "gallery"))
        wall = time.perf_counter() - started
        assert result["state"] == "complete", result
        tags = client.get_run(result["mlflow_run_id"]).data.tags
        row = {"scenario": scenario, "items": len(images), "wall_seconds": round(wall, 1),
               "embed_seconds": round(embed_seconds, 1), "overhead_seconds": round(wall - embed_seconds, 1),
               "check": tags.get("check"), "map_version": tags.get("map_version")}
        rows.append(row)
        print(row, flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "upgrade_overhead.json").write_text(json.dumps(rows, indent=1))
    lines = ["The upgrade's wall time against embedding the same items, one run "
             f"(`.venv/bin/python benchmarks/upgrade_overhead.py`), {len(images)} items, local store, in seconds:", "",
             "| scenario | upgrade wall | embed every item | overhead | map check |", "|---|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['wall_seconds']} | {r['embed_seconds']} | {r['overhead_seconds']} | "
              f"{(r['check'] or '')[:80]} |" for r in rows]
    (out / "upgrade_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
