"""`fastfill evaluate`: the backfill curve of your own features (no model, no registry, no store)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from fastfill.cli import app
from fastfill.cli.command_support import USAGE, fail
from fastfill.cli.json_output import JsonOption, answer, answers_json
from fastfill.components.evaluation.byof import EvaluationInputError, evaluate_feature_folder
from fastfill.components.platform.vocabulary import DISTANCES

# the choices of --distance (mypy reads an Enum's members from a literal only)
Distance = Enum("Distance", {name: name for name in DISTANCES}, type=str)  # type: ignore[misc]


@app.command()
@answers_json
def evaluate(features: Annotated[Path, typer.Option(
                 help="folder with query.npy, gallery_new.npy, gallery_old.npy, labels.npy [, order.npy]")],
             distance: Annotated[Distance, typer.Option(help="l2, or cosine on L2-normalised vectors")] = Distance["l2"],
             out: Annotated[Path | None, typer.Option(help="JSON file to write; default: print it")] = None,
             points: Annotated[int, typer.Option(help="intermediate curve points B (the curve has B+2)")] = 20,
             old_query: Annotated[Path | None, typer.Option(
                 "--old-query", help="the old model's features of the queries (.npy, n x d_old): adds the shadow "
                 "index's curves (dual: rrf, score_minmax, score_zscore) on the old model's own gallery features, "
                 "gallery_old_raw.npy if the folder has it, else gallery_old.npy")] = None,
             as_json: JsonOption = False) -> None:
    """Evaluate your own features: the backfill curve and its summaries, as JSON; with
    --old-query, also the shadow index's curves under "dual" (docs/methods.md)."""
    try:
        result = evaluate_feature_folder(features, distance=distance.value, num_intermediate=points, old_query=old_query)
    except EvaluationInputError as error:
        fail(error, USAGE)
    text = json.dumps(result, indent=2)
    if as_json:  # the document on stdout; --out still writes the plain result
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text + "\n")
        return answer("fastfill.evaluate/1", {**result, "written": str(out) if out is not None else None})
    if out is None:
        typer.echo(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        lines = [f"top1_auc {100 * result['top1_auc']:.2f}%, map_auc {100 * result['map_auc']:.2f}%"]
        lines += [f"dual {merge}: top1_auc {100 * curve['top1_auc']:.2f}%, map_auc {100 * curve['map_auc']:.2f}%"
                  for merge, curve in result.get("dual", {}).items()]
        typer.echo("; ".join(lines) + f"; written to {out}")
