"""benchmarks/team_upgrade.py's team and what it brings: two model versions copied into a registry
of its own (or two tiny ones trained first), a gallery of PNGs with a manifest and no labels, a
golden set of judged queries, moto's S3 server with the images uploaded, and each backend's
params.yaml.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.team_upgrade_commands import CALLER_ENV_DROPPED, FASTFILL, clean_env, error_lines, run_command

FASHION = Path("/usr/share/datasets/fashion-mnist")
BUCKET = "team-gallery"


def train_tiny_models(folder: Path, timeout: float) -> dict:
    """Two tiny models (embedder v1 @champion, v2 @challenger) by ``fastfill run`` on the tiny demo's
    configuration and a small synthetic ImageFolder, in ``folder`` (outside the scratch)."""
    import yaml

    from testkit.tiny_demo import make_image_folder, tiny_params

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

    from fastfill.components.model_store import registered

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

    from fastfill.components.model_store import registered
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import load_params

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
    registry.end_run(client, run.info.run_id)
    if out["old"]["version"] != "1" or out["new"]["version"] != "2":
        raise SystemExit(f"{config.tracking_uri}: the copies became versions {out['old']['version']} and "
                         f"{out['new']['version']}, not 1 and 2 of a fresh registry")
    return out


def gallery_images(tiny: bool, items: int, seed: int):
    """(ids, uint8 images (N, H, W), labels, where they come from)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if tiny:
        from testkit.tiny_demo import class_image

        labels = rng.integers(0, 6, size=items)
        images = np.stack([class_image(int(label), rng, 16, 6) for label in labels])
        ids = np.sort(rng.choice(100_000, size=items, replace=False))
        return ids, images, labels, "synthetic 16x16 bars, 6 classes (components/experiment/tiny_demo.class_image)"
    from fastfill.components.experiment.data import load_raw_dataset
    from fastfill.components.platform.config import PrepareConfig

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
