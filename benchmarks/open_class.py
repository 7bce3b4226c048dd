"""Open-class evaluation (the FastFill paper's appendix C.3): the old model, the new model, the
maps and RACT's compatible model train on some classes only; the test split holds only classes
none of them saw. Does the sigma order still beat random there, and does RACT's entropy order?

    .venv/bin/python benchmarks/open_class.py --unseen 6 7 8 9 --train-per-class all --seed 0

Runs the pipeline of params.yaml with prepare.unseen_classes set (and RACT added as a compatible
model) under runs/open-class/n-<per class>/, then writes reports/open_class-n<per class>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from fastfill.components.platform.config import Params, load_params  # noqa: E402


def open_class_params(params: Params, unseen: list[int], per_class: int | None, seed: int, out: Path) -> Params:
    data = params.model_dump(mode="json")
    data["prepare"].update(unseen_classes=unseen, train_per_class=per_class, old_classes=None)
    data["paths"].update(data=str(out / "data"))
    # RACT is trained by the pipeline here, with the comparison's settings when it has them (a
    # method may be defined once, so it leaves compare.compatible)
    ract = data["compare"]["compatible"].pop("ract", None) or {"loss": "ract", "lam": 1.0, "tau": 0.05}
    data["compare"]["orders"] = {}
    data["compatible"] = {"ract": ract}
    data["evaluate"]["orders"] = {"fct": ["random"], "fastfill": ["sigma", "random", "oracle"],
                                  "ract": ["entropy", "random"]}
    data["evaluate"]["headline_order"] = {"fct": "random", "fastfill": "sigma", "ract": "entropy"}
    return Params.model_validate(data).with_seed(seed).with_outputs_under(out / f"seed-{seed}")


def report(metrics: dict, unseen: list[int], per_class: int | None, seed: int) -> tuple[str, dict]:
    rows = {"fct (random)": metrics["fct"]["by_order"]["random"]}
    for order in ("sigma", "random", "oracle"):
        rows[f"fastfill ({order})"] = metrics["fastfill"]["by_order"][order]
    for order in ("entropy", "random"):
        rows[f"ract ({order})"] = metrics["ract"]["by_order"][order]
    answers = {
        "sigma_beats_random": {k: metrics["fastfill"]["by_order"]["sigma"][k] - metrics["fastfill"]["by_order"]["random"][k]
                               for k in ("top1_auc", "map_auc")},
        "entropy_beats_random": {k: metrics["ract"]["by_order"]["entropy"][k] - metrics["ract"]["by_order"]["random"][k]
                                 for k in ("top1_auc", "map_auc")},
        "fastfill_sigma_minus_fct": {k: metrics["fastfill"]["by_order"]["sigma"][k] - metrics["fct"]["by_order"]["random"][k]
                                     for k in ("top1_auc", "map_auc")},
    }
    lines = [f"Open-class evaluation: models and maps trained on the classes other than {unseen} "
             f"({per_class or 'all'} training images per class), evaluated on the test images of {unseen} only "
             f"(seed {seed}), in %.", "",
             f"old/old top-1 {100 * metrics['old_old']['top1_0']:.2f}, mAP {100 * metrics['old_old']['map_0']:.2f}; "
             f"new/new top-1 {100 * metrics['new_new']['top1_0']:.2f}, mAP {100 * metrics['new_new']['map_0']:.2f}.", "",
             "| row | top1_auc | map_auc |", "|---|---|---|"]
    lines += [f"| {name} | {100 * r['top1_auc']:.2f} | {100 * r['map_auc']:.2f} |" for name, r in rows.items()]
    lines.append("")
    for name, gaps in answers.items():
        lines.append(f"- {name.replace('_', ' ')}: top1_auc {100 * gaps['top1_auc']:+.2f}, "
                     f"map_auc {100 * gaps['map_auc']:+.2f}")
    check = metrics["fastfill"].get("map_check")
    if check:
        order = f" ({check['fallback_order']} order)" if "fallback_order" in check else ""
        lines.append(f"- FastFill's map check: {check['outcome']}{order}")
    return "\n".join(lines) + "\n", {"rows": rows, "answers": answers, "map_check": check}


def _per_class(text: str) -> int | None:
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive count or all, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count or all, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unseen", nargs="+", type=int, default=[6, 7, 8, 9])
    parser.add_argument("--train-per-class", type=_per_class, default=None,
                        help="training images per seen class, or all (the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="runs/open-class")
    args = parser.parse_args()
    from fastfill.flows.pipeline import pipeline_flow
    from fastfill.flows.prepare import prepare_flow

    label = f"n{args.train_per_class or 'all'}"
    params = open_class_params(load_params(args.params), args.unseen, args.train_per_class, args.seed,
                               Path(args.out) / label)
    prepare_flow(params)
    metrics = pipeline_flow(params, prepare=False, aliases=False)
    markdown, data = report(metrics, args.unseen, args.train_per_class, args.seed)
    Path("reports").mkdir(exist_ok=True)
    Path(f"reports/open_class-{label}.md").write_text(markdown)
    Path(f"reports/open_class-{label}.json").write_text(json.dumps({"unseen": args.unseen, "seed": args.seed,
                                                           "train_per_class": args.train_per_class, **data}, indent=1))
    print(markdown)


if __name__ == "__main__":
    main()
