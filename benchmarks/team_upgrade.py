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

``--tiny`` trains two tiny models first (``fastfill run`` on
``components/experiment/tiny_demo.tiny_params`` and a small ImageFolder, in a temporary folder of
its own, outside the scratch folder) and adopts ~200 PNGs of the same synthetic kind, judged 40: a
check that the whole path works, in a few minutes.

Writes ``<out>.md`` (the tables) and ``<out>.json`` (every number); default
``reports/team_upgrade``. Exit status: 0 when every step ended as expected (the finish may be a
gate rejection, exit 3) and nothing outside the scratch folder was read; 1 otherwise.

This file runs the script; its parts are beside it: ``team_upgrade_inputs`` (the team's models,
images, golden set, S3 server and params), ``team_upgrade_backend`` (one backend's commands and
what MLflow recorded), ``team_upgrade_commands`` (running a command, reading what it printed),
``team_upgrade_strace`` (the check that nothing outside the scratch folder was read) and
``team_upgrade_report`` (the tables).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.team_own_models import write_report  # noqa: E402
from benchmarks.team_upgrade_backend import run_backend  # noqa: E402
from benchmarks.team_upgrade_commands import CALLER_ENV_DROPPED, ROOT, clean_env, error_lines  # noqa: E402
from benchmarks.team_upgrade_inputs import (  # noqa: E402
    BUCKET,
    backend_params,
    gallery_images,
    read_versions,
    register_copies,
    start_s3,
    train_tiny_models,
    upload_images,
    write_gallery,
    write_judgments,
)
from benchmarks.team_upgrade_report import markdown  # noqa: E402
from benchmarks.team_upgrade_strace import ALSO_WATCHED, MUST_NOT_READ, STRACE_FILTER, check_traces  # noqa: E402


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
    for key in CALLER_ENV_DROPPED:  # this process reads and writes the registries it names itself
        if key.startswith(("MLFLOW", "FASTFILL", "PREFECT")):
            os.environ.pop(key, None)
    from fastfill.components.platform import runtime

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
    out = write_report(args.out, markdown(report), report)
    print(f"written: {out.with_suffix('.md')} and {out.with_suffix('.json')}; scratch folder kept: {scratch}")
    bad = report["problems"] or (use_strace and report["strace"]["must_not_read_hits"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
