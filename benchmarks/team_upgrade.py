"""What a retrieval team does to upgrade its gallery's model, through the real CLI, measured.

A team has two registered model versions (the deployed one and a better one), a gallery of image
files, and a golden set of judged queries. It has none of this project's pipeline output: no
``data/`` splits, no ``artifacts/``, no alignment map. This script plays that team in a scratch
folder and times every command it runs:

1. **Two model versions in a registry of its own.** The versions are read from a source MLflow
   store (by default the project's, where ``fastfill run`` registers ``embedder@champion``, the
   old model, and ``embedder@challenger``, the new one) with ``registered.load_model`` and
   registered again, from their weights, in a fresh SQLite MLflow store of the scratch folder
   (``registered.register_embedder``): the old one as ``champion``, the new one as
   ``challenger``. Only the two embedders are copied, never an alignment map: the upgrade has to
   train its map on the gallery's own items (``gallery.upgrade.map_pairs: gallery``).
2. **A gallery of image files.** ``--items`` PNGs from the Fashion-MNIST test split (the IDX files
   of the Debian package, read by the project's reader) and a manifest CSV with ``id`` and ``uri``
   only: no label column. The labels stay in this script's memory.
3. **Adopted where they are**, with ``fastfill gallery adopt``: on a local folder store, and on S3
   (moto's server on a free 127.0.0.1 port, fake credentials, ``AWS_ENDPOINT_URL_S3``; the images
   are uploaded to the bucket and the gallery is ``s3://<bucket>/gallery``).
4. **A golden set**: ``--judged`` queries, each a gallery item, judged relevant to every other
   gallery item of its class. That is what a golden set with class-level relevance looks like
   (every item of the same category is a correct answer, every other one is not); the file has
   two columns, ``query`` and ``relevant``, one judged pair a row.
5. **The upgrade, per backend**: the dry run with the golden set and the advisor's stop
   (``--stop-when-gain-below``), the upgrade that stops there on its own, ``upgrade status``,
   then the same upgrade without a stop, which goes to 100% and lets the promotion gate decide.
   Each command's wall time, what it predicted (the dry run's lines, ``status``'s prediction),
   what was measured (the upgrade's MLflow run), where it stopped (``items_done`` of ``status``)
   and the gate's decision are recorded.
6. **Nothing outside the scratch folder is read**: every ``fastfill`` command runs under
   ``strace -f -y -e trace=%file`` (every system call that takes a path: open, openat, stat,
   newfstatat, statx, access, ...; ``-y`` gives each descriptor's and the working folder's path,
   so relative paths resolve exactly) and each path under the project's ``data/`` or
   ``artifacts/`` is reported (there must be none), as are paths of the project's own MLflow
   store (``mlruns.db``, ``mlartifacts/``) and default gallery (``gallery/``), and in ``--tiny``
   anything of the folder the tiny models were trained in. Without strace the commands still run
   from a folder with no ``data/``, and the report says the check was not made. Timings under
   strace include its overhead (``--strace off`` for clean timings).

Each backend is a team of its own: a sub-folder of the scratch folder (``local/`` or ``s3/``) with
its own ``params.yaml``, MLflow store and Prefect home, so one backend's promotion (``champion``
moved, ``challenger`` cleared) does not change what the other one upgrades. The images, the
manifest and the golden set are shared. Every command runs as
``.venv/bin/fastfill ... --params <scratch>/<backend>/params.yaml`` with that sub-folder as its
working folder, without ``MLFLOW_TRACKING_URI``, ``FASTFILL_STORE`` or ``PREFECT_API_URL`` from
the caller (each command runs its flows on a temporary Prefect server).

A step that fails (a rejected option, a refusal, an error) is reported with its exit code and last
lines, and the script goes on with the next one.

    .venv/bin/python benchmarks/team_upgrade.py                        # the default run's models, 2000 items
    .venv/bin/python benchmarks/team_upgrade.py --tiny --out /tmp/team  # tiny models trained here, 200 items

``--tiny`` trains two tiny models first (``fastfill run`` on ``components/experiment/tiny_demo.tiny_params`` and a
small ImageFolder, in a temporary folder of its own, outside the scratch folder) and adopts ~200
PNGs of the same synthetic kind, judged 40: a check that the whole path works, in a few minutes.

Writes ``<out>.md`` (the tables) and ``<out>.json`` (every number); default
``reports/team_upgrade``. Exit status: 0 when every step ended as expected (the finish may be a
gate rejection, exit 3) and nothing outside the scratch folder was read; 1 otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FASTFILL = ROOT / ".venv" / "bin" / "fastfill"
FASHION = Path("/usr/share/datasets/fashion-mnist")
BUCKET = "team-gallery"
# project outputs a team's commands must never touch (the first two: the brief's hard rule)
MUST_NOT_READ = ("data", "artifacts")
ALSO_WATCHED = ("mlruns.db", "mlartifacts", "gallery")
MUST_NOT_READ_ROOTS = {f"project {d}" for d in MUST_NOT_READ} | {"tiny models"}
STRACE_FILTER = "trace=%file"
CALLER_ENV_DROPPED = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "FASTFILL_STORE", "PREFECT_API_URL",
                      "PREFECT_API_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


# ------------------------------------------------------------------------------------------------
# Parsing what the commands print (pure functions: tests/unit/test_team_upgrade_script.py)

_NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
_CURVE_ROW = re.compile(r"^\s+(\d+)%\s+([0-9.]+) ± ([0-9.]+)\s+([0-9.]+) ± ([0-9.]+)(?:\s+([0-9.]+))?\s*$")
# the label-free prediction (no labels): one number a row, the agreement with the finished upgrade
_AGREEMENT_ROW = re.compile(r"^\s+(\d+)%\s+([0-9.]+)\s*$")
_RECOMMENDED = re.compile(
    r"recommended stop for a gain below ([0-9.]+) (top-1|agreement) points per 5%: (\d+)% \(([0-9,]+) items "
    r"embedded, ([0-9,]+) not\); predicted (?:top-1|agreement) ([0-9.]+) there"
    r"(?:, ([0-9.]+) at 100% \(([0-9.]+) points given up\))?")
_OUTCOME = re.compile(r"^([a-z][a-z -]*): (\d+) of (\d+) items backfilled \(([0-9.]+)%\) in (\d+) s; MLflow run (\S+)")
_ADVISED = re.compile(r"^budget advisor: recommended stop for a gain below ([0-9.]+) (top-1|agreement) points per 5% "
                      r"is (\d+)% \(predicted (?:top-1|agreement) ([0-9.]+), ([0-9.]+) at 100%\)(.*)$")
_GATE = re.compile(r"^promotion gate: (passed, champion moved|REJECTED): champion top-1 ([0-9.]+), challenger mean "
                   r"top-1 along the backfill ([0-9.]+), NFR@1 ([0-9.]+)%, gain reached at (never|[0-9]+%)")
_ADOPTED = re.compile(r"^(\S+): (\d+) items adopted, model (\S+);")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_dry_run(text: str) -> dict:
    """The dry run's plan as numbers: items, chunks, the estimated backfill, what the gate and the
    advisor measure against, the predicted curve (points, %: top-1 and mAP, or the label-free
    agreement) and the recommended stop."""
    out: dict = {"curve": []}
    agreement = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("dry run:"):
            out["headline"] = stripped
        elif stripped.startswith("items ") and "chunks of" in stripped:
            m = re.match(r"items ([0-9,]+) in ([0-9,]+) parts; ([0-9,]+) chunks of ([0-9,]+); images (.*)", stripped)
            if m:
                out.update(items=_int(m[1]), parts=_int(m[2]), chunks=_int(m[3]), chunk_size=_int(m[4]),
                           images=m[5])
        elif stripped.startswith("estimated backfill:"):
            m = re.match(r"estimated backfill: ([0-9.]+) (s|h)", stripped)
            if m:
                out["estimated_backfill_seconds"] = float(m[1]) * (3600 if m[2] == "h" else 1)
        elif stripped.startswith("measured on "):
            out["sample_line"] = stripped
        elif stripped.startswith("truth of the gate and the advisor:"):
            out["truth"] = stripped.split(":", 1)[1].strip()
        elif stripped.startswith("map pairs"):
            out["map_pairs"] = stripped.split(":", 1)[1].strip()
        elif stripped.startswith("budget advisor:"):
            out["advisor_note"] = stripped.split(":", 1)[1].strip()
        elif stripped.startswith(("predicted backfill curve", "predicted agreement")):
            out["curve_header"] = stripped
            agreement = stripped.startswith("predicted agreement")
            out["metric"] = "agreement" if agreement else "top1"
        m = _CURVE_ROW.match(line)
        if m:
            out["curve"].append({"fraction": int(m[1]) / 100, "top1": float(m[2]), "top1_se": float(m[3]),
                                 "map": float(m[4]), "map_se": float(m[5])})
        m = _AGREEMENT_ROW.match(line) if agreement else None
        if m:
            out["curve"].append({"fraction": int(m[1]) / 100, "agreement": float(m[2])})
        m = _RECOMMENDED.search(line)
        if m:
            metric = "top1" if m[2] == "top-1" else "agreement"
            out["recommended"] = {"gain_below": float(m[1]), "metric": metric, "fraction": int(m[3]) / 100,
                                  "items": _int(m[4]), "items_saved": _int(m[5]), metric: float(m[6])}
            if m[7] is not None:
                out["recommended"].update({f"{metric}_full": float(m[7]), f"{metric}_given_up": float(m[8])})
    return out


def parse_upgrade(text: str) -> dict:
    """An upgrade command's outcome: state, items done, the advisor's stop, the gate's numbers
    and reasons."""
    out: dict = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        m = _OUTCOME.match(stripped)
        if m:
            out.update(state=m[1], items_done=int(m[2]), items=int(m[3]), percent=float(m[4]),
                       command_seconds=int(m[5]), mlflow_run_id=m[6])
        if stripped.startswith("up-to-date:"):
            out.update(state="up-to-date", message=stripped)
        m = _ADVISED.match(stripped)
        if m:
            metric = "top1" if m[2] == "top-1" else "agreement"
            out["advised"] = {"gain_below": float(m[1]), "metric": metric, "fraction": int(m[3]) / 100,
                              metric: float(m[4]), f"{metric}_full": float(m[5]), "stopped_there": "stopped there" in m[6]}
        m = _GATE.match(stripped)
        if m:
            reasons = []
            for follow in lines[i + 1:]:
                if not follow.startswith("  - "):
                    break
                reasons.append(follow[4:].strip())
            out["gate"] = {"passed": m[1].startswith("passed"), "champion_top1": float(m[2]),
                           "challenger_top1_auc": float(m[3]), "nfr1_percent": float(m[4]),
                           "gain_reached_at": None if m[5] == "never" else int(m[5].rstrip("%")) / 100,
                           "reasons": reasons}
    return out


def parse_json_output(text: str) -> dict | None:
    """The JSON object a command printed on stdout (``upgrade status``), or None."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:text.rfind("}") + 1])
    except json.JSONDecodeError:
        return None


_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::.*)?$")
_FRAME = re.compile(r"/[\w./-]+\.py:\d+ in \w+")


def error_lines(stdout: str, stderr: str, keep: int = 6) -> list[str]:
    """What a failed command said: its ``error:`` lines if any, else its last non-empty lines
    (usage errors come in a box; its frame is dropped)."""
    text = [line.rstrip() for line in (stderr + "\n" + stdout).splitlines()]
    errors = [line for line in text if line.lstrip("│ ").startswith("error:")]
    if errors:
        return errors[-keep:]
    raised = [i for i, line in enumerate(text) if _EXCEPTION.match(line)]
    if raised:  # a traceback (rich draws it in a box): where it was raised, the line, the exception
        last = raised[-1]
        where = [line.strip("│ ").strip() for line in text[:last] if _FRAME.search(line)]
        code = [line.strip("│ ").strip() for line in text[:last] if "❱" in line]
        return ([f"raised at {where[-1]}"] if where else []) + ([code[-1]] if code else []) + [text[last].strip()]
    meaningful = [line.strip("│╭╮╰╯─ ").strip() for line in text]
    return [line for line in meaningful if line][-keep:]


# strace -y: "1234 openat(AT_FDCWD</cwd>, "rel/path", O_RDONLY) = 3</abs/path>" and the like
_STRACE_LINE = re.compile(r"^(?:\[pid\s+)?(\d+)\]?\s+(?:<\.\.\. )?(\w+)(?: resumed>)?\(?(.*)$")
_PATH_ARG = re.compile(r'(?:(AT_FDCWD|-?\d+)(?:<([^>]*)>)?,\s*)?"((?:[^"\\]|\\.)*)"')
_RESULT = re.compile(r"=\s+(-?\d+)(?:<([^>]*)>)?(?:\s+(E[A-Z]+))?")


def strace_paths(line: str) -> tuple[str, list[str], str] | None:
    """(system call, the absolute paths it named, "ok" or the errno) of one strace -f -y line;
    None for a line that names no path (signals, exits, unfinished halves without a path)."""
    m = _STRACE_LINE.match(line)
    if not m:
        return None
    call, rest = m[2], m[3]
    paths: list[str] = []
    args = _PATH_ARG.search(rest)
    if args:
        base, path = args[2], args[3].encode().decode("unicode_escape", errors="replace")
        if path.startswith("/"):
            paths.append(os.path.normpath(path))
        elif path == "" and base:  # newfstatat(3</x>, "", ..., AT_EMPTY_PATH)
            paths.append(os.path.normpath(base))
        elif base:
            paths.append(os.path.normpath(os.path.join(base, path)))
        elif path:
            paths.append(path)  # relative without a known base: kept as it is
    end = rest.rfind(") = ")  # the return value (a path may hold " = ", never the call's own ") = ")
    result = _RESULT.search(rest[end + 1:]) if end >= 0 else None
    if result and result[2]:  # the descriptor returned, resolved by the kernel
        paths.append(os.path.normpath(result[2]))
    status = "ok" if result and not result[3] else (result[3] if result else "unfinished")
    return (call, sorted(set(paths)), status) if paths else None


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def strace_hits(lines, roots: dict[str, str]) -> dict[str, list[dict]]:
    """Per watched root (name -> absolute path), the distinct (path, call, status) that touched
    it, with how many times."""
    found: dict[str, dict[tuple, int]] = {name: {} for name in roots}
    for line in lines:
        parsed = strace_paths(line)
        if parsed is None:
            continue
        call, paths, status = parsed
        for path in paths:
            for name, root in roots.items():
                if under(path, root):
                    key = (path, call, status)
                    found[name][key] = found[name].get(key, 0) + 1
    return {name: [{"path": p, "call": c, "status": s, "count": n} for (p, c, s), n in sorted(hits.items())]
            for name, hits in found.items()}


def judged_pairs(ids, labels, queries: int, rng) -> list[tuple[int, int]]:
    """``queries`` gallery items drawn at random, each judged relevant to every other gallery item
    of its class (class-level relevance): (query id, relevant id) rows."""
    import numpy as np

    ids, labels = np.asarray(ids), np.asarray(labels)
    chosen = np.sort(rng.choice(len(ids), size=min(queries, len(ids)), replace=False))
    rows = []
    for q in chosen:
        same = np.flatnonzero(labels == labels[q])
        rows += [(int(ids[q]), int(ids[r])) for r in same if r != q]
    return rows


# ------------------------------------------------------------------------------------------------
# Running a command


def run_command(argv: list[str], cwd: Path, env: dict, timeout: float, trace: Path | None) -> dict:
    """Run ``argv`` (under strace when ``trace`` is a file), timed; never raises for its failure.
    A command past ``timeout`` is ended with its process group (this script started it)."""
    # --seccomp-bpf: only the traced calls stop the process (without it every system call does, and
    # a training thread pool runs many times slower under strace)
    full = (["strace", "-f", "--seccomp-bpf", "-y", "-qq", "-e", STRACE_FILTER, "-o", str(trace)] + argv) if trace else argv
    started = time.perf_counter()
    process = subprocess.Popen(full, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        rc = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        rc = None
    return {"argv": argv, "cwd": str(cwd), "rc": rc, "timed_out": rc is None,
            "seconds": round(time.perf_counter() - started, 2), "stdout": stdout, "stderr": stderr,
            "strace": str(trace) if trace else None}


# ------------------------------------------------------------------------------------------------
# The team's inputs


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CALLER_ENV_DROPPED}
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "200"  # one line per message, not wrapped to a narrow pipe
    return env


def train_tiny_models(folder: Path, timeout: float) -> dict:
    """Two tiny models (embedder v1 @champion, v2 @challenger) by ``fastfill run`` on the tiny demo's
    configuration and a small synthetic ImageFolder, in ``folder`` (outside the scratch)."""
    import yaml

    from components.experiment.tiny_demo import make_image_folder, tiny_params

    images = make_image_folder(folder / "imagefolder", num_classes=6, train_per_class=40, test_per_class=12)
    data = tiny_params(images)
    data["mlflow"]["tracking_uri"] = f"sqlite:///{folder / 'mlruns.db'}"
    data["mlflow"]["artifact_location"] = str(folder / "mlartifacts")
    (folder / "params.yaml").write_text(yaml.safe_dump(data))
    env = clean_env()
    env["PREFECT_HOME"] = str(folder / "prefect-home")
    result = run_command([str(FASTFILL), "run", "--params", str(folder / "params.yaml"), "--no-dvc-commit"],
                         folder, env, timeout, None)
    if result["rc"] != 0:
        raise SystemExit("training the tiny models failed (exit {}):\n{}".format(
            result["rc"], "\n".join(error_lines(result["stdout"], result["stderr"], 20))))
    reference = {}
    metrics = folder / "reports" / "metrics.json"
    if metrics.is_file():  # the tiny pipeline's own test split: how good the two models are
        found = json.loads(metrics.read_text())
        reference = {row: {k: round(100 * found[row][k], 2) for k in ("top1_0", "top1_100", "map_0", "map_100")
                           if k in found.get(row, {})} for row in ("old_old", "new_new", "fct", "fastfill") if row in found}
    return {"seconds": result["seconds"], "folder": str(folder), "tracking_uri": data["mlflow"]["tracking_uri"],
            "params": data, "pipeline_reference_percent": reference}


def read_versions(tracking_uri: str, name: str, old: str | None, new: str | None) -> dict:
    """The two source versions (aliases champion and challenger by default), loaded as models."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from components.experiment import registered

    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[len("sqlite:///"):]).is_file():
        raise SystemExit(f"{tracking_uri}: no such MLflow store. Run `fastfill run` first (it registers @champion and "
                         "@challenger), give --source-tracking-uri, or use --tiny")
    # read only: no experiment is created in the source store (registry.setup would create one).
    # mlflow.set_*_uri export MLFLOW_TRACKING_URI/MLFLOW_REGISTRY_URI, which would then override
    # every later registry of this process (the copies'): they are taken out again below.
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        os.environ.pop(key, None)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = {}
    for role, given, alias in (("old", old, "champion"), ("new", new, "challenger")):
        try:
            version = given or client.get_model_version_by_alias(name, alias).version
            entry = client.get_model_version(name, str(version))
        except MlflowException as error:
            raise SystemExit(
                f"{tracking_uri}: no {name} {'version ' + given if given else '@' + alias} ({error.error_code}). "
                "Run `fastfill run` first (it registers @champion and @challenger), give --source-tracking-uri "
                "and --old-version/--new-version, or use --tiny") from None
        uri = f"models:/{name}/{version}"
        found[role] = {"source_uri": uri, "version": str(version), "tags": dict(entry.tags),
                       "model": registered.load_model(uri), "input_shape": list(registered.input_shape(uri) or [])}
    return found


def register_copies(params_file: Path, versions: dict) -> dict:
    """The two versions in the backend's own fresh registry: old @champion, new @challenger."""
    import numpy as np

    from components.experiment import registered
    from components.platform import registry
    from components.platform.config import load_params

    config = load_params(params_file).mlflow
    client, experiment = registry.setup(config)
    run = client.create_run(experiment, run_name="copy two embedder versions")
    out = {}
    for role, alias in (("old", "champion"), ("new", "challenger")):
        item = versions[role]
        example = np.zeros((1, *item["input_shape"]), dtype=np.float32)
        tags = {k: v for k, v in item["tags"].items() if k in ("role",)}
        tags["copied_from"] = f"{versions['source']} {item['source_uri']}"
        version = registered.register_embedder(client, run.info.run_id, item["model"], example,
                                               config.registered_model, alias, tags)
        out[role] = {"version": version, "alias": alias, "uri": f"models:/{config.registered_model}/{version}"}
    registry.finish(client, run.info.run_id)
    if out["old"]["version"] != "1" or out["new"]["version"] != "2":
        raise SystemExit(f"{config.tracking_uri}: the copies became versions {out['old']['version']} and "
                         f"{out['new']['version']}, not 1 and 2 of a fresh registry")
    return out


def gallery_images(tiny: bool, items: int, seed: int):
    """(ids, uint8 images (N, H, W), labels, where they come from)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if tiny:
        from components.experiment.tiny_demo import class_image

        labels = rng.integers(0, 6, size=items)
        images = np.stack([class_image(int(label), rng, 16, 6) for label in labels])
        ids = np.sort(rng.choice(100_000, size=items, replace=False))
        return ids, images, labels, "synthetic 16x16 bars, 6 classes (components/experiment/tiny_demo.class_image)"
    from components.experiment.data import load_raw_dataset
    from components.platform.config import PrepareConfig

    with tempfile.TemporaryDirectory(prefix="team-upgrade-idx-") as cache:  # the unpacked IDX files
        test = load_raw_dataset(PrepareConfig(dataset="fashion-mnist", source=FASHION), Path(cache)).test
    index = np.sort(rng.choice(len(test), size=min(items, len(test)), replace=False))
    # the item ids are the test split's indices: sparse, as a real catalogue's are
    return index, test.images[index, 0], test.labels[index], f"Fashion-MNIST test split ({FASHION})"


def write_gallery(scratch: Path, ids, images) -> dict:
    from PIL import Image

    folder = scratch / "images"
    folder.mkdir()
    started = time.perf_counter()
    size = 0
    for item, image in zip(ids, images):
        path = folder / f"{int(item)}.png"
        Image.fromarray(image).save(path)
        size += path.stat().st_size
    with open(scratch / "manifest.csv", "w", newline="") as handle:  # no label column
        writer = csv.writer(handle)
        writer.writerow(["id", "uri"])
        writer.writerows((int(item), f"{int(item)}.png") for item in ids)
    return {"items": len(ids), "bytes": size, "seconds": round(time.perf_counter() - started, 2),
            "manifest": str(scratch / "manifest.csv"), "folder": str(folder)}


def write_judgments(scratch: Path, ids, labels, queries: int, seed: int) -> dict:
    import numpy as np

    rows = judged_pairs(ids, labels, queries, np.random.default_rng(seed + 1))
    path = scratch / "judgments.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["query", "relevant"])
        writer.writerows(rows)
    distinct = len({q for q, _ in rows})
    return {"file": str(path), "queries": distinct, "rows": len(rows),
            "relevant_per_query": round(len(rows) / max(distinct, 1), 1),
            "relevance": "class-level: every other gallery item of the query's class"}


def start_s3():
    """moto's S3 server on a free loopback port (as tests/integration/conftest.py's s3_endpoint),
    with fake credentials: (server, the environment the commands need)."""
    from moto.server import ThreadedMotoServer

    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for key in CALLER_ENV_DROPPED:
        if key.startswith("AWS_"):
            os.environ.pop(key, None)
    os.environ.update(creds)
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    os.environ["AWS_ENDPOINT_URL_S3"] = url
    return server, {**creds, "AWS_ENDPOINT_URL_S3": url}


def upload_images(endpoint: str, folder: Path) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    files = sorted(folder.iterdir())
    started = time.perf_counter()

    def put(path: Path) -> None:
        client.put_object(Bucket=BUCKET, Key=f"images/{path.name}", Body=path.read_bytes(), ContentType="image/png")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, files))
    return {"objects": len(files), "seconds": round(time.perf_counter() - started, 2),
            "root": f"s3://{BUCKET}/images"}


def backend_params(base: dict, folder: Path, store: str, chunk_size: int | None) -> Path:
    """The backend's params.yaml: the team's configuration with its own registry and store."""
    import copy

    import yaml

    data = copy.deepcopy(base)
    data.setdefault("mlflow", {}).update(tracking_uri=f"sqlite:///{folder / 'mlruns.db'}",
                                         artifact_location=str(folder / "mlartifacts"))
    gallery = data.setdefault("gallery", {})
    gallery["store"] = store
    if chunk_size:
        gallery.setdefault("upgrade", {})["chunk_size"] = chunk_size
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------------------
# One backend's upgrade


def describe_step(name: str, step: dict) -> str:
    """One cell: what the command said, in a line."""
    if step["timed_out"]:
        return f"TIMED OUT after {step['seconds']:.0f} s: " + " / ".join(error_lines(step["stdout"], step["stderr"], 2))
    parsed = step.get("parsed") or {}
    if step["rc"] not in (0, 3):
        return f"FAILED (exit {step['rc']}): " + " / ".join(error_lines(step["stdout"], step["stderr"], 3))
    if name == "adopt":
        m = next((_ADOPTED.match(line) for line in step["stdout"].splitlines() if _ADOPTED.match(line)), None)
        warn = " (warned: no labels, no judgments configured)" if "has no label column" in step["stderr"] else ""
        return (f"{m[2]} items adopted, model {m[3]}" if m else step["stdout"].strip()[:200]) + warn
    if name == "dry run":
        bits = []
        if "estimated_backfill_seconds" in parsed:
            bits.append(f"estimated backfill {parsed['estimated_backfill_seconds']:.0f} s")
        if parsed.get("truth"):
            bits.append(f"truth: {parsed['truth']}")
        metric = parsed.get("metric", "top1")
        label = "top-1" if metric == "top1" else "agreement with the finished upgrade"
        if parsed.get("recommended"):
            r = parsed["recommended"]
            bits.append(f"recommended stop {100 * r['fraction']:.0f}% ({r['items']} items), predicted {label} "
                        f"{r[metric]:.2f} there" + (f", {r[metric + '_full']:.2f} at 100%" if metric + "_full" in r else ""))
        elif parsed.get("curve"):
            bits.append(f"predicted {label} {parsed['curve'][0][metric]:.2f} at 0%, {parsed['curve'][-1][metric]:.2f} "
                        "at 100%, no recommended stop")
        elif parsed.get("advisor_note"):
            bits.append(f"advisor: {parsed['advisor_note']}")
        return "; ".join(bits) or step["stdout"].strip().splitlines()[0][:200]
    if name == "status":
        status = parsed
        if not status:
            return step["stdout"].strip()[:200]
        upgrade = status.get("upgrade") or {}
        text = f"state {status.get('state')}, model {status.get('model')}"
        if upgrade:
            text += f", items_done {upgrade.get('items_done')} of {status.get('items')}"
            predicted = upgrade.get("predicted") or {}
            rec = predicted.get("recommendation")
            if rec:
                text += f", recommended stop {100 * rec['fraction']:.0f}%" + (
                    f" (by {predicted['metric']})" if isinstance(predicted.get("metric"), str) else "")
        return text
    if parsed.get("state") == "up-to-date":
        return parsed["message"]
    if "state" in parsed:
        text = (f"{parsed['state']}: {parsed['items_done']} of {parsed['items']} items ({parsed['percent']:.1f}%) in "
                f"{parsed['command_seconds']} s")
        if parsed.get("advised"):
            a = parsed["advised"]
            text += (f"; advisor ({'top-1' if a['metric'] == 'top1' else 'agreement'}): stop at "
                     f"{100 * a['fraction']:.0f}%" + (" (stopped there)" if a["stopped_there"] else ""))
        if parsed.get("gate"):
            g = parsed["gate"]
            text += (f"; gate {'PASSED' if g['passed'] else 'REJECTED'}: champion top-1 {g['champion_top1']:.2f}, "
                     f"challenger mean top-1 {g['challenger_top1_auc']:.2f}, NFR@1 {g['nfr1_percent']:.2f}%")
        return text
    return " / ".join(error_lines(step["stdout"], step["stderr"], 2))


def mlflow_numbers(params_file: Path, run_id: str | None) -> dict:
    """The upgrade's MLflow run (every metric's history, its tags) and the registry's aliases."""
    from components.platform import registry
    from components.platform.config import load_params

    config = load_params(params_file).mlflow
    client, _ = registry.setup(config)
    out: dict = {"aliases": {}}
    for alias in ("champion", "challenger"):
        out["aliases"][alias] = registry.alias_version(client, config.registered_model, alias)
    versions = client.search_model_versions(f"name='{config.registered_model}'")
    out["version_tags"] = {v.version: {k: t for k, t in v.tags.items() if k.startswith(("promotion", "role"))}
                           for v in versions}
    if not run_id:
        return out
    run = client.get_run(run_id)
    out["run"] = {"id": run_id, "name": run.info.run_name, "status": run.info.status,
                  "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
                  "metrics": {}}
    for key in sorted(run.data.metrics):
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        out["run"]["metrics"][key] = [[m.step, m.value] for m in history]
    return out


def predicted_vs_measured(metrics: dict, items: int | None) -> dict | None:
    """Where the run logged both the prediction (predicted_top1/map) and the measurement
    (top1/map) at the same step (items backfilled): the gaps in points."""
    out = {}
    for metric in sorted(k[len("predicted_"):] for k in metrics if k.startswith("predicted_")):
        predicted = {s: v for s, v in metrics.get(f"predicted_{metric}", [])}
        measured = {s: v for s, v in metrics.get(metric, [])}
        common = sorted(set(predicted) & set(measured))
        if not common:
            continue
        gaps = [abs(predicted[s] - measured[s]) * 100 for s in common]
        out[metric] = {"points": len(common), "largest_gap": round(max(gaps), 2),
                       "mean_gap": round(sum(gaps) / len(gaps), 2),
                       "at": [{"items": s, "fraction": round(s / items, 4) if items else None,
                               "predicted": round(100 * predicted[s], 2), "measured": round(100 * measured[s], 2)}
                              for s in common]}
    return out or None


def annotate(by: dict) -> None:
    """Notes on outcomes that are not what the step asked for, or are the consequence of an
    earlier one: an upgrade asked to stop at the advisor's stop that did not pause, and a finish
    refused because the same version was rejected one step before."""
    dry = by["dry run"].get("parsed") or {}
    stop = by["upgrade to the advised stop"]
    parsed = stop.get("parsed") or {}
    if parsed.get("state") and parsed["state"] != "paused":
        if parsed.get("advised") and parsed["advised"]["fraction"] >= 1:
            stop["note"] = (f"the advisor's stop was 100%, so it ran to the end and the gate decided: "
                            f"{parsed['state']}")
            stop["ok"] = stop["rc"] in (0, 3)
        else:
            why = "the advisor recommended no stop" + (f" (dry run: {dry['advisor_note']})"
                                                        if dry.get("advisor_note") else "")
            stop["note"] = (f"did not pause at the advisor's stop: it went to {parsed['percent']:.0f}% and ended "
                            f"{parsed['state']}; {why}")
            stop["ok"] = False
    finish = by["upgrade to 100% (gate)"]
    if (finish["rc"] == 6 and "was rejected by the promotion gate" in finish["stderr"]
            and parsed.get("state") == "rejected"):
        finish["note"] = ("expected after the previous step: the gate had already rejected this version, and a gallery "
                          "refuses a rejected version again (docs/upgrade.md)")
        finish["ok"] = True


def gate_curve(metrics: dict) -> list[dict] | None:
    """The gate's measured curve (gate.top1, gate.nfr1: one point per step of the curve, 0% to
    100% evenly), in %."""
    top1 = [v for _, v in sorted(metrics.get("gate.top1", []))]
    if not top1:
        return None
    nfr1 = [v for _, v in sorted(metrics.get("gate.nfr1", []))]
    last = max(len(top1) - 1, 1)
    return [{"fraction": round(i / last, 4), "top1": round(100 * v, 2),
             "nfr1": round(100 * nfr1[i], 2) if i < len(nfr1) else None} for i, v in enumerate(top1)]


def run_backend(name: str, folder: Path, params_file: Path, store: str, root: str, manifest: Path, judgments: Path,
                gain: float, env: dict, timeout: float, use_strace: bool) -> dict:
    fastfill = [str(FASTFILL)]
    common = ["--store", store, "--params", str(params_file)]
    steps_argv = [
        ("adopt", ["gallery", "adopt", "--manifest", str(manifest), "--root", root] + common),
        ("dry run", ["upgrade", "--dry-run", "--judgments", str(judgments),
                     "--stop-when-gain-below", f"{gain:g}"] + common),
        ("upgrade to the advised stop", ["upgrade", "--judgments", str(judgments), "--stop-when-gain-below", f"{gain:g}",
                                         "--no-progress"] + common),
        ("status", ["upgrade", "status"] + common),
        ("upgrade to 100% (gate)", ["upgrade", "--judgments", str(judgments), "--no-progress"] + common),
        ("final status", ["upgrade", "status"] + common),
    ]
    traces = folder.parent / "strace"
    traces.mkdir(exist_ok=True)
    steps = []
    for i, (step_name, argv) in enumerate(steps_argv):
        trace = traces / f"{name}-{i}.txt" if use_strace else None
        print(f"[{name}] {step_name}: fastfill {' '.join(argv)}", flush=True)
        step = run_command(fastfill + argv, folder, env, timeout, trace)
        step["name"] = step_name
        kind = "status" if "status" in step_name else "adopt" if step_name == "adopt" else \
            "dry run" if step_name == "dry run" else "upgrade"
        if kind == "dry run":
            step["parsed"] = parse_dry_run(step["stdout"])
        elif kind == "status":
            step["parsed"] = parse_json_output(step["stdout"]) if step["rc"] == 0 else None
        elif kind == "upgrade":
            step["parsed"] = parse_upgrade(step["stdout"])
        step["said"] = describe_step(kind, step)
        step["ok"] = step["rc"] == 0 or (step["rc"] == 3 and step_name.startswith("upgrade to 100%"))
        print(f"[{name}]   {step['seconds']:.1f} s, exit {step['rc']}: {step['said']}", flush=True)
        steps.append(step)
    by = {s["name"]: s for s in steps}
    annotate(by)
    status = by["status"].get("parsed") or {}
    upgrade = status.get("upgrade") or {}
    stop = by["upgrade to the advised stop"].get("parsed") or {}
    finish = by["upgrade to 100% (gate)"].get("parsed") or {}
    run_id = upgrade.get("mlflow_run_id") or stop.get("mlflow_run_id") or finish.get("mlflow_run_id")
    try:
        recorded = mlflow_numbers(params_file, run_id)
    except Exception as error:  # noqa: BLE001 - reported, the other backend goes on
        recorded = {"error": f"{type(error).__name__}: {error}"}
    metrics = (recorded.get("run") or {}).get("metrics", {})
    return {
        "store": store, "images_root": root, "params": str(params_file), "steps": steps,
        "predicted": {"dry_run": by["dry run"].get("parsed"), "status": upgrade.get("predicted"),
                      "advised_stop": stop.get("advised")},
        "stopped_at": {"items_done": upgrade.get("items_done"), "items": status.get("items"),
                       "fraction": upgrade.get("fraction"), "state": status.get("state"),
                       "chunks_done": upgrade.get("chunks_done"), "chunks": upgrade.get("chunks")} if upgrade else None,
        "gate": finish.get("gate"), "finish_state": finish.get("state"),
        "final_status": by["final status"].get("parsed"),
        "mlflow": recorded, "predicted_vs_measured": predicted_vs_measured(metrics, status.get("items")),
        "gate_curve": gate_curve(metrics),
    }


def check_traces(report: dict, roots: dict[str, str], scratch: Path, keep: bool) -> dict:
    """Each backend's steps' strace logs against the watched roots; the logs are deleted unless
    ``keep``. The distinct paths seen under the scratch folder are counted too: the proof that the
    trace saw the command's own reads."""
    out = {"available": True, "filter": STRACE_FILTER, "roots": roots, "per_step": {}, "must_not_read_hits": 0,
           "scratch_paths_seen": {}}
    for backend, result in report["backends"].items():
        for step in result["steps"]:
            path = step.get("strace")
            if not path or not Path(path).is_file():
                continue
            with open(path, errors="replace") as handle:
                hits = strace_hits(handle, {**roots, "scratch": str(scratch)})
            seen = len({hit["path"] for hit in hits.pop("scratch")})
            out["scratch_paths_seen"][f"{backend}: {step['name']}"] = seen
            hits = {name: found for name, found in hits.items() if found}
            out["per_step"][f"{backend}: {step['name']}"] = hits
            step["outside_reads"] = {name: len(found) for name, found in hits.items()}
            out["must_not_read_hits"] += sum(len(found) for name, found in hits.items() if name in MUST_NOT_READ_ROOTS)
            if not keep:
                Path(path).unlink()
    return out


# ------------------------------------------------------------------------------------------------
# The report


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# A retrieval team's upgrade, through the CLI ({report['mode']})", "",
             f"- models: {c['source']} (old v{c['old_version']} -> new v{c['new_version']}), copied into each "
             "backend's own registry as v1 @champion and v2 @challenger",
             f"- gallery: {report['setup']['images']['items']} PNGs, {report['setup']['images']['source']}; manifest "
             "id, uri (no label column)",
             f"- golden set: {report['setup']['judgments']['queries']} queries, "
             f"{report['setup']['judgments']['rows']} judged pairs ({report['setup']['judgments']['relevance']})",
             f"- stop when the predicted gain is below {c['gain']:g} points per 5% (top-1; agreement for a label-free "
             "prediction)",
             *([f"- the tiny models on their own pipeline's test split (%): " + "; ".join(
                 f"{row} " + ", ".join(f"{k} {v:.1f}" for k, v in values.items())
                 for row, values in report["setup"]["train_tiny_models"]["pipeline_reference_percent"].items())]
               if report["setup"].get("train_tiny_models", {}).get("pipeline_reference_percent") else []),
             f"- wall time of the whole script: {report['wall_seconds']:.0f} s; {report['machine']}",
             f"- strace: {report['strace_note']}", ""]
    for name, backend in report["backends"].items():
        lines += [f"## {name}: {backend['store']}", "", "| step | seconds | exit | what it said |", "|---|---:|---:|---|"]
        for step in backend["steps"]:
            said = step["said"] + (f" (**{step['note']}**)" if step.get("note") else "")
            said = said.replace("|", "\\|")
            outside = step.get("outside_reads")
            if outside:
                said += " **read outside the scratch folder: " + ", ".join(f"{k} {v}" for k, v in outside.items()) + "**"
            lines.append(f"| {step['name']} | {step['seconds']:.1f} | {step['rc']} | {said} |")
        lines.append("")
        stopped = backend.get("stopped_at")
        if not stopped:
            final = backend["steps"][3].get("parsed") or {}
            lines.append(f"- stopped at: nowhere; after the stop step `upgrade status` found state {final.get('state')} "
                         "and no upgrade in progress")
        else:
            lines.append(f"- stopped at: items_done {stopped['items_done']} of {stopped['items']} "
                         f"({100 * stopped['fraction']:.1f}%), chunks {stopped['chunks_done']} of {stopped['chunks']}, "
                         f"state {stopped['state']}")
        pvm = backend.get("predicted_vs_measured")
        if pvm:
            for metric, gap in pvm.items():
                lines.append(f"- predicted vs measured {metric} (MLflow run, {gap['points']} points): largest gap "
                             f"{gap['largest_gap']:.2f}, mean {gap['mean_gap']:.2f} points")
        elif "error" in backend["mlflow"]:
            lines.append(f"- MLflow: {backend['mlflow']['error']}")
        else:
            keys = sorted((backend["mlflow"].get("run") or {}).get("metrics", {}))
            lines.append("- predicted vs measured: nothing to compare, the upgrade's MLflow run has no "
                         "predicted_<m> with a measured <m>; its metrics: " + (", ".join(keys) if keys else "none (no run found)"))
        metrics = (backend["mlflow"].get("run") or {}).get("metrics", {})
        for key in sorted(k for k in metrics if k.startswith("predicted_")):
            points = sorted(metrics[key])
            items = (backend.get("stopped_at") or {}).get("items") or max((s for s, _ in points), default=0) or 1
            picks = [points[0], points[len(points) // 2], points[-1]] if len(points) > 2 else points
            lines.append(f"- predicted at planning (MLflow {key}, step = items backfilled): " + ", ".join(
                f"{100 * v:.2f} at {100 * step / items:.0f}%" for step, v in picks))
        curve = backend.get("gate_curve")
        if curve:
            picks = [curve[0], curve[len(curve) // 2], curve[-1]]
            lines.append("- measured by the gate (MLflow gate.top1, gate.nfr1): top-1 " + ", ".join(
                f"{p['top1']:.2f} at {100 * p['fraction']:.0f}%" for p in picks)
                + (f"; NFR@1 {curve[0]['nfr1']:.2f}% at 0%" if curve[0]["nfr1"] is not None else ""))
        gate = backend.get("gate")
        if gate:
            lines.append(f"- gate: {'passed' if gate['passed'] else 'REJECTED'}; " + "; ".join(gate["reasons"]))
        aliases = backend["mlflow"].get("aliases")
        if aliases:
            lines.append(f"- registry afterwards: champion v{aliases.get('champion')}, challenger "
                         f"v{aliases.get('challenger')}")
        lines.append("")
    if report["problems"]:
        lines += ["## Steps that failed", ""]
        lines += [f"- {p['backend']}: {p['step']} (exit {p['rc']}): `{' / '.join(p['said'])}`" for p in report["problems"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="an empty or new scratch folder (default: a new temporary one)")
    parser.add_argument("--items", type=int, help="gallery PNGs (default 2000; --tiny 200)")
    parser.add_argument("--judged", type=int, help="judged queries (default 300; --tiny 40)")
    parser.add_argument("--stop-when-gain-below", type=float, default=0.1, dest="gain")
    parser.add_argument("--backends", default="local,s3", help="local,s3 (default both)")
    parser.add_argument("--source-tracking-uri", help="where the two versions are registered (default: the project's "
                                                      "mlflow.tracking_uri, resolved against the project)")
    parser.add_argument("--registered-model", help="default: the project's mlflow.registered_model")
    parser.add_argument("--old-version", help="default: the source's @champion")
    parser.add_argument("--new-version", help="default: the source's @challenger")
    parser.add_argument("--chunk-size", type=int, help="gallery.upgrade.chunk_size (default: params.yaml's; --tiny 20)")
    parser.add_argument("--tiny", action="store_true", help="tiny models trained here, ~200 synthetic PNGs, 40 judged")
    parser.add_argument("--strace", choices=("auto", "on", "off"), default="auto",
                        help="auto: when strace is installed; on: required")
    parser.add_argument("--keep-strace", action="store_true", help="keep the strace logs under <workdir>/strace")
    parser.add_argument("--step-timeout", type=float, default=3600.0, help="seconds per command")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "team_upgrade",
                        help="writes OUT.md and OUT.json (default reports/team_upgrade)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    for key in CALLER_ENV_DROPPED:  # this process reads and writes the registries it names itself
        if key.startswith(("MLFLOW", "FASTFILL", "PREFECT")):
            os.environ.pop(key, None)
    from components.platform import runtime

    runtime.apply_defaults()
    import yaml

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - {"local", "s3"}:
        parser.error("--backends: local, s3 or local,s3")
    items = args.items or (200 if args.tiny else 2000)
    judged = args.judged or (40 if args.tiny else 300)
    if args.tiny and (args.source_tracking_uri or args.old_version or args.new_version):
        parser.error("--tiny trains its own two models: leave out --source-tracking-uri and the versions")
    use_strace = args.strace != "off" and shutil.which("strace") is not None
    if args.strace == "on" and not use_strace:
        parser.error("--strace on: strace is not installed (apt-get install -y strace)")

    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        parser.error(f"--workdir {args.workdir} is not empty: give an empty or new folder")
    project = yaml.safe_load((ROOT / "params.yaml").read_text())
    name = args.registered_model or project["mlflow"]["registered_model"]
    setup: dict = {}
    tiny_folder = None
    if args.tiny:
        tiny_folder = Path(tempfile.mkdtemp(prefix="team-upgrade-tiny-models-")).resolve()
        print(f"training two tiny models in {tiny_folder} (fastfill run) ...", flush=True)
        trained = train_tiny_models(tiny_folder, args.step_timeout)
        setup["train_tiny_models"] = {k: v for k, v in trained.items() if k != "params"}
        source = trained["tracking_uri"]
        base_params = trained["params"]
        base_params.pop("promotion", None)  # the tiny demo's configuration turns the gate off; a team keeps it
        base_params.pop("prepare", None)  # the training images are the model builders', not the team's
        base_params["gallery"] = {"part_size": 50}
        chunk_size = args.chunk_size or 20
    else:
        source = args.source_tracking_uri or project["mlflow"]["tracking_uri"]
        if source.startswith("sqlite:///") and not source.startswith("sqlite:////"):
            source = "sqlite:///" + str((ROOT / source[len("sqlite:///"):]).resolve())
        base_params = project
        chunk_size = args.chunk_size

    started_copy = time.perf_counter()
    versions = read_versions(source, name, args.old_version, args.new_version)
    versions["source"] = source
    setup["read_source_versions_seconds"] = round(time.perf_counter() - started_copy, 2)
    scratch = (args.workdir or Path(tempfile.mkdtemp(prefix="team-upgrade-"))).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"scratch folder: {scratch}", flush=True)
    ids, images, labels, image_source = gallery_images(args.tiny, items, args.seed)
    setup["images"] = {**write_gallery(scratch, ids, images), "source": image_source,
                       "per_class": {int(c): int((labels == c).sum()) for c in sorted(set(labels.tolist()))},
                       "image_shape": list(images.shape[1:])}
    setup["judgments"] = write_judgments(scratch, ids, labels, judged, args.seed)
    del labels  # from here on, the only truth is the golden set

    env = clean_env()
    server = None
    report: dict = {
        "mode": "tiny" if args.tiny else "default", "scratch": str(scratch),
        "machine": f"{os.cpu_count()} CPU cores, {os.uname().sysname} {os.uname().machine}",
        "config": {"source": source, "registered_model": name, "old_version": versions["old"]["version"],
                   "new_version": versions["new"]["version"], "items": items, "judged": judged, "gain": args.gain,
                   "backends": backends, "chunk_size": chunk_size, "seed": args.seed, "strace": use_strace},
        "setup": setup, "backends": {}, "problems": [],
    }
    try:
        for backend in backends:
            folder = scratch / backend
            folder.mkdir()
            backend_env = {**env, "PREFECT_HOME": str(folder / "prefect-home")}
            if backend == "s3":
                if server is None:
                    server, aws = start_s3()
                    setup["s3"] = {"endpoint": aws["AWS_ENDPOINT_URL_S3"], "bucket": BUCKET,
                                   **upload_images(aws["AWS_ENDPOINT_URL_S3"], scratch / "images")}
                backend_env.update(aws)
                store, root = f"s3://{BUCKET}/gallery", setup["s3"]["root"]
            else:
                store, root = str(folder / "gallery"), str(scratch / "images")
            params_file = backend_params(base_params, folder, store, chunk_size)
            started_copy = time.perf_counter()
            copied = register_copies(params_file, versions)
            copied["seconds"] = round(time.perf_counter() - started_copy, 2)
            setup.setdefault("registry_copy", {})[backend] = copied
            result = run_backend(backend, folder, params_file, store, root, scratch / "manifest.csv",
                                 scratch / "judgments.csv", args.gain, backend_env, args.step_timeout, use_strace)
            report["backends"][backend] = result
            for step in result["steps"]:
                if not step["ok"]:
                    said = ([step["note"]] if step.get("note") else []) + (
                        error_lines(step["stdout"], step["stderr"], 8) if step["rc"] not in (0, 3) else [step["said"]])
                    report["problems"].append({"backend": backend, "step": step["name"], "rc": step["rc"],
                                               "said": said})
    finally:
        if server is not None:
            server.stop()

    roots = {f"project {d}": str(ROOT / d) for d in MUST_NOT_READ}
    roots.update({f"project {d}": str(ROOT / d) for d in ALSO_WATCHED})
    if tiny_folder is not None:
        roots["tiny models"] = str(tiny_folder)
    if use_strace:
        report["strace"] = check_traces(report, roots, scratch, args.keep_strace)
        hits = report["strace"]["must_not_read_hits"]
        seen = report["strace"]["scratch_paths_seen"].values()
        watched = {k: v for step in report["strace"]["per_step"].values() for k, v in step.items()}
        report["strace_note"] = (f"every fastfill command ran under strace ({STRACE_FILTER}); paths under the project's "
                                 f"data/ or artifacts/{' or the tiny models folder' if tiny_folder else ''}: {hits}"
                                 f" (the trace saw {min(seen, default=0)} to {max(seen, default=0)} distinct paths "
                                 "under the scratch folder per command)"
                                 + (f"; also touched: {', '.join(sorted(watched))}" if watched else
                                    "; nothing of the project's mlruns.db, mlartifacts/ or gallery/ either"))
    else:
        report["strace"] = {"available": False}
        report["strace_note"] = ("NOT CHECKED: strace is not installed (or --strace off); the commands ran from "
                                 f"{scratch}/<backend>, a folder with no data/ or artifacts/")
    if tiny_folder is not None:  # the source registry: copied into the scratch folder's, no longer needed
        shutil.rmtree(tiny_folder, ignore_errors=True)
    # the pipeline's layout (paths.data, paths.artifacts) relative to the commands' working folders
    report["scratch_after"] = {"data/ or artifacts/ created in the scratch folder": sorted(
        str(p.relative_to(scratch)) for base in (scratch, *(scratch / b for b in backends)) for d in MUST_NOT_READ
        for p in [base / d] if p.exists())}
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    for result in report["backends"].values():
        for step in result["steps"]:  # the JSON keeps the tails, not whole logs
            step["stdout_tail"] = step.pop("stdout")[-4000:]
            step["stderr_tail"] = step.pop("stderr")[-4000:]
    text = markdown(report)
    print("\n" + text)
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    print(f"written: {out.with_suffix('.md')} and {out.with_suffix('.json')}; scratch folder kept: {scratch}")
    bad = report["problems"] or (use_strace and report["strace"]["must_not_read_hits"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
