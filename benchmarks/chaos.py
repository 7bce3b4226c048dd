"""The long chaos run: a gallery on an S3 endpoint (moto's server in its own process) behind a
proxy that fails a share of requests, and `fastfill upgrade` SIGKILLed (its whole process group)
at uniform random moments, then run again, until it completes. Side by side, the same upgrade of
the same gallery on a local folder with no faults and no kills. Printed: kills and where they
landed, faults injected by kind, runs, wall time of each path, and the checks (every item covered
once, no finished chunk redone, features bit-identical, gallery, registry and lock agreeing).

    .venv/bin/python benchmarks/chaos.py --items 10000 --kills 10 --fault-rate 0.1

It first runs the tiny pipeline (synthetic 16x16 images, a few minutes on 2 cores) for a registry
with a champion, a challenger and their maps; the gallery is its test images repeated to --items.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastfill.components.platform import runtime  # noqa: E402,F401  (Prefect settings before Prefect loads)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _moto(port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return process
        except OSError:
            time.sleep(0.2)
    raise SystemExit("chaos: moto's server did not start")


def _cli(workdir: Path, env: dict, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastfill.cli", *args, "--params", str(workdir / "params.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=10000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--fault-rate", type=float, default=0.1)
    parser.add_argument("--chunk-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()

    from fastfill.components.gallery.layouts.catalog import PartsGallery
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.store.lock import LOCK
    from fastfill.components.gallery.upgrade import backfill, ending, planning
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import parse_params
    from fastfill.flows.pipeline import pipeline_flow
    from testkit.process_state import in_workdir
    from testkit.s3_fault_proxy import CONNECTION_FAULTS, STATUS_FAULTS, FaultProxy
    from testkit.tiny_demo import make_image_folder, tiny_params

    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="chaos-"))
    print(f"chaos: working in {workdir}", flush=True)
    data = tiny_params(make_image_folder(workdir / "images"))
    data["mlflow"]["tracking_uri"] = f"sqlite:///{workdir / 'mlflow.db'}"
    data["mlflow"]["artifact_location"] = str(workdir / "mlartifacts")
    data["paths"] = {k: str(workdir / v) for k, v in data["paths"].items()}
    data["gallery"] = {"part_size": 1000, "upgrade": {"chunk_size": args.chunk_size, "max_concurrency": 2}}
    (workdir / "params.yaml").write_text(yaml.safe_dump(data))
    params = parse_params(data)
    started = time.perf_counter()
    with in_workdir(workdir):
        pipeline_flow(params)
    print(f"chaos: registry ready in {time.perf_counter() - started:.0f} s", flush=True)

    from fastfill.components.experiment.data import load_split
    from fastfill.components.platform.layout import Layout

    test = load_split(Layout(params.paths).splits, "test")
    reps = -(-args.items // len(test.labels))
    np.save(workdir / "images.npy", np.concatenate([test.images] * reps)[:args.items])
    np.save(workdir / "labels.npy", np.concatenate([test.labels] * reps)[:args.items])

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    env = dict(os.environ, PREFECT_HOME=str(workdir / "prefect-home"))
    env.pop("MLFLOW_TRACKING_URI", None)
    port = _free_port()
    moto = _moto(port)
    results: dict = {"items": args.items, "kills_asked": args.kills, "fault_rate": args.fault_rate}
    try:
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="chaos")
        ingest = ["gallery", "ingest", "--images", str(workdir / "images.npy"), "--labels", str(workdir / "labels.npy")]
        local, remote = str(workdir / "reference"), "s3://chaos/gallery"

        started = time.perf_counter()
        for store in (local,):
            done = _cli(workdir, env, *ingest, "--store", store, timeout=1800)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        client, _ = registry.setup(params.mlflow)
        name = params.mlflow.registered_model
        old_version = str(client.get_model_version_by_alias(name, "champion").version)
        new_version = str(client.get_model_version_by_alias(name, "challenger").version)
        reference = _cli(workdir, env, "upgrade", "--store", local, "--no-progress", timeout=3600)
        assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
        results["reference_seconds"] = round(time.perf_counter() - started, 1)
        client.set_registered_model_alias(name, "champion", old_version)  # the chaos run starts where it did
        client.set_registered_model_alias(name, "challenger", new_version)  # the promotion cleared it

        with FaultProxy(f"http://127.0.0.1:{port}", rate=args.fault_rate, kinds=STATUS_FAULTS + CONNECTION_FAULTS,
                        seed=args.seed, slow_seconds=1.0) as proxy:
            env["AWS_ENDPOINT_URL_S3"] = os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url  # this process reads through it too
            started = time.perf_counter()
            done = _cli(workdir, env, *ingest, "--store", remote, timeout=3600)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            store = open_store(remote)  # this process reads through the proxy too
            kills, runs, tokens = [], 0, {}  # chunk -> the token of its marker when a kill found it done
            span = max(5.0, results["reference_seconds"])
            command = [sys.executable, "-m", "fastfill.cli", "upgrade", "--store", remote, "--no-progress",
                       "--params", str(workdir / "params.yaml")]
            final = None
            while True:
                runs += 1
                process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                if len(kills) < args.kills:
                    at = rng.uniform(0, span)
                    try:
                        out, _ = process.communicate(timeout=at)
                    except subprocess.TimeoutExpired:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.communicate()
                        manifest = store.get_json("gallery.json")
                        uid = manifest.get("upgrade")
                        for chunk in (backfill.done_chunks(store, uid) if uid else []):
                            tokens.setdefault(chunk, store.get_json(planning.marker_key(uid, chunk))["token"])
                        kills.append({"after_s": round(at, 2), "planned": bool(uid),
                                      "chunks_done": len(backfill.done_chunks(store, uid)) if uid else 0})
                        print(f"chaos: kill {len(kills)} after {at:.1f} s: {kills[-1]}", flush=True)
                        continue
                else:
                    out, _ = process.communicate(timeout=3600)
                final = (process.returncode, out.decode(errors="replace"))
                if process.returncode == 0 or runs > args.kills + 5:
                    break
            results["chaos_seconds"] = round(time.perf_counter() - started, 1)
            results["runs"], results["kills"] = runs, kills
            results["faults"] = dict(proxy.faults)
            results["faults_injected"], results["requests"] = proxy.injected, proxy.requests
            assert final[0] == 0, final[1][-3000:]

            gallery, reference_gallery = PartsGallery(store), PartsGallery(open_store(local))
            new = reference_gallery.model
            uid = planning.upgrade_id(registry.ModelRef(name, old_version), new)
            plan = planning.load_plan(store, uid)
            markers = {c: store.get_json(planning.marker_key(uid, c)) for c in backfill.done_chunks(store, uid)}
            order = planning.order_of(store, uid)
            covered = np.sort(np.concatenate([order[m["start"]:m["stop"]] for m in markers.values()]))
            checks = {
                "every chunk once": len(markers) == plan.num_chunks,
                "every item once": bool(np.array_equal(covered, np.arange(plan.num_items))),
                "no finished chunk redone": all(markers[c]["token"] == t for c, t in tokens.items()),
                "features bit-identical": bool(np.array_equal(gallery.all_features(new),
                                                              reference_gallery.all_features(new))),
                "gallery on the new model": gallery.manifest(refresh=True)["model"]["version"] == new.version,
                "champion moved": str(client.get_model_version_by_alias(name, "champion").version) == new.version,
                "decision recorded in the registry": bool((found := ending.decision(store, uid)) and found.registry_recorded),
                "lock released": not store.exists(LOCK),
            }
            results["checks"] = checks
    finally:
        os.killpg(moto.pid, signal.SIGKILL)
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    if not all(results["checks"].values()):
        raise SystemExit("chaos: a check failed")


if __name__ == "__main__":
    main()
