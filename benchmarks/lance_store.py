"""The parts layout against the Lance table, side by side in one run: the same upgrade through
the same product functions on a gallery kept in each layout.

    .venv/bin/python benchmarks/lance_store.py                       # 100,000 items, local and S3
    .venv/bin/python benchmarks/lance_store.py --items 1000000 --where local
    .venv/bin/python benchmarks/lance_store.py --items 5000 --chunk 500   # a quick look
    .venv/bin/python benchmarks/lance_store.py --pixels     # an ingested gallery: images in the store
    .venv/bin/python benchmarks/lance_store.py --png        # an adopted one: PNG files read by URI

For each layout (``parts``: components/gallery/layouts/catalog.py; ``lance``:
components/gallery/layouts/table.py), through the product's own adopt (or ingest), commit_plan,
write_chunk and finish, and each location (a local folder; S3 on a moto server started here, reached through a counting
proxy), one process of its own runs the same upgrade of a features-only gallery (``--items`` x
``--dim`` float32, ids and image URIs; the new model's features as random rows):

- adopt: the gallery written (items and the serving model's features);
- plan: h(old), log sigma^2 and the backfill order written for every item;
- chunks: every chunk of ``--chunk`` items committed, the first half by one writer, the second
  half by ``--writers`` threads at once; the median latency of a commit and items per second;
- finish: the new features become the gallery's (parts: one object per part; Lance: one
  column added in one commit);
- read: the served features of every item read back (checksums or digests checked).

Printed and written to reports/lance_store.{json,md}: seconds per step, the ratio lance/parts,
peak RSS per process, bytes stored, and (S3) the HTTP requests each made. The sizes here are small
next to a production gallery, and moto is not S3: the ratios say more than the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STEPS = ("adopt", "plan", "chunks_1_writer", "chunks_n_writers", "finish", "read")
IMAGE_SHAPE = (1, 28, 28)


def _data(items: int, dim: int, seed: int = 0, pixels: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    data = {"old": rng.standard_normal((items, dim), dtype=np.float32),
            "mapped": rng.standard_normal((items, dim), dtype=np.float32),
            "new": rng.standard_normal((items, dim), dtype=np.float32),
            "sigma": rng.standard_normal(items, dtype=np.float32), "order": rng.permutation(items)}
    if pixels:  # an ingested gallery: its images (1 x 28 x 28 uint8, decoded PNGs) kept in the store
        data["pixels"] = rng.integers(0, 256, (items, *IMAGE_SHAPE), dtype=np.uint8)
    return data


def _items(items: int, png_root: str | None = None):
    import pyarrow as pa

    uris = [f"{i:08d}.png" for i in range(items)] if png_root else [f"s3://images/{i:08d}.png" for i in range(items)]
    return pa.table({"id": pa.array(np.arange(items, dtype=np.int64)), "uri": pa.array(uris)})


def write_pngs(pixels: np.ndarray, root: str) -> None:
    """Each image as ``<root>/<position:08d>.png`` (a folder, or s3://bucket/prefix)."""
    import io
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    def encoded(i: int) -> bytes:
        out = io.BytesIO()
        Image.fromarray(pixels[i][0], mode="L").save(out, format="PNG")
        return out.getvalue()

    if root.startswith("s3://"):
        import boto3

        bucket, _, prefix = root[len("s3://"):].partition("/")
        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])

        def put(i: int) -> None:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{i:08d}.png", Body=encoded(i))
    else:
        Path(root).mkdir(parents=True, exist_ok=True)

        def put(i: int) -> None:
            (Path(root) / f"{i:08d}.png").write_bytes(encoded(i))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(len(pixels))))


def _chunks(order: np.ndarray, size: int) -> list[tuple[int, int, int, np.ndarray]]:
    return [(c, start, min(start + size, len(order)), order[start:start + size])
            for c, start in enumerate(range(0, len(order), size))]


def _commit_all(commit, chunks, writers: int) -> dict:
    """The first half one by one, the rest by ``writers`` threads: seconds and latencies."""
    half = len(chunks) // 2
    latencies = []

    def one(chunk):
        start = time.perf_counter()
        commit(chunk)
        latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    for chunk in chunks[:half]:
        one(chunk)
    single = time.perf_counter() - start
    single_latency = statistics.median(latencies) if latencies else 0.0
    latencies.clear()
    start = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(one, chunks[half:]))
    many = time.perf_counter() - start
    return {"chunks_1_writer": single, "chunks_n_writers": many, "latency_1_writer": single_latency,
            "latency_n_writers": statistics.median(latencies) if latencies else 0.0,
            "items_1_writer": sum(c[2] - c[1] for c in chunks[:half]),
            "items_n_writers": sum(c[2] - c[1] for c in chunks[half:])}


def run_layout(uri: str, data: dict, chunk: int, writers: int, layout: str) -> dict:
    """One upgrade through the product's own functions (adopt or ingest, commit_plan, write_chunk,
    finish, the served features read back) on the gallery kept in ``layout``."""
    from fastfill.components.gallery.inputs.adopt import adopt
    from fastfill.components.gallery.layouts.catalog import fetch_images, ingest
    from fastfill.components.gallery.layouts.opening import gallery_at, layout_of
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.upgrade import ending
    from fastfill.components.gallery.upgrade.backfill import write_chunk
    from fastfill.components.gallery.upgrade.planning import Plan, commit_plan, sigma_key, transformed_key
    from fastfill.components.platform.registry import ModelRef

    items, dim = data["old"].shape
    old, new = ModelRef("embedder", "1", dim), ModelRef("embedder", "2", dim)
    store, kind = open_store(uri), layout_of(layout)
    times = {}
    start = time.perf_counter()
    if "pixels" in data and not data.get("png_root"):
        ingest(store, data["pixels"], data["old"], old, ids=np.arange(items), part_size=1000, layout=kind)
    else:
        adopt(store, _items(items, data.get("png_root")), old, IMAGE_SHAPE, root=data.get("png_root"),
              features=iter([data["old"]]), part_size=1000, layout=kind)
    times["adopt"] = time.perf_counter() - start

    start = time.perf_counter()
    gallery = gallery_at(store)
    plan = Plan("u1", old, new, "models:/map/1", "sigma", chunk, items, 0, "l2")
    for part in range(gallery.num_parts):
        lo, hi = gallery.part_bounds(part)
        store.put_array(transformed_key(plan.upgrade_id, part), data["mapped"][lo:hi])
        store.put_array(sigma_key(plan.upgrade_id, part), data["sigma"][lo:hi])
    commit_plan(gallery, plan, data["order"])
    times["plan"] = time.perf_counter() - start

    reading = gallery_at(store)

    def commit(c):
        number, lo, hi, positions = c
        if "pixels" in data:  # the chunk's images read back, as a backfill does before embedding them
            images, failures = fetch_images(reading, positions, workers=16)
            assert not failures and np.array_equal(images, data["pixels"][positions])
        write_chunk(store, plan.upgrade_id, number, lo, hi, data["new"][positions], time.perf_counter())

    times.update(_commit_all(commit, _chunks(data["order"], chunk), writers))
    start = time.perf_counter()
    ending.finish(gallery_at(store), plan)
    times["finish"] = time.perf_counter() - start
    start = time.perf_counter()
    served = gallery_at(store).all_features(new)
    times["read"] = time.perf_counter() - start
    assert np.array_equal(served, data["new"]), f"the {layout} layout served other features"
    return times


def stored_bytes(uri: str) -> int:
    if uri.startswith("s3://"):
        import boto3

        bucket, _, prefix = uri[5:].partition("/")
        client = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3"))
        total = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total
    return sum(p.stat().st_size for p in Path(uri).rglob("*") if p.is_file() and not p.is_symlink())


def worker(args) -> None:
    """One backend at one location, in this process; one JSON line on stdout."""
    data = _data(args.items, args.dim, pixels=args.pixels or bool(args.png_root))
    if args.png_root:
        data["png_root"] = args.png_root
    proxy = None
    if args.uri.startswith("s3://"):
        from testkit.s3_fault_proxy import FaultProxy

        proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL_S3"], rate=0.0).__enter__()
        upstream = os.environ["AWS_ENDPOINT_URL_S3"]
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url
    times = run_layout(args.uri, data, args.chunk, args.writers, args.backend)
    result = {"backend": args.backend, "uri": args.uri, "seconds": times,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if proxy is not None:
        result["requests"] = proxy.requests
        os.environ["AWS_ENDPOINT_URL_S3"] = upstream
        proxy.__exit__()
    result["bytes_stored"] = stored_bytes(args.uri)
    print(json.dumps(result), flush=True)


def _median_run(runs: list[dict]) -> dict:
    """One backend's runs at one location as one: the median of each figure over the runs."""
    median = dict(runs[0])
    median["seconds"] = {key: statistics.median(run["seconds"][key] for run in runs) for key in runs[0]["seconds"]}
    for key in ("peak_rss_mb", "bytes_stored", "requests"):
        if key in runs[0]:
            median[key] = statistics.median(run[key] for run in runs)
    median["runs"] = len(runs)
    return median


def markdown(results: list[dict], args) -> str:
    lines = ["# The parts layout against the Lance table", "",
             f"`python benchmarks/lance_store.py --items {args.items} --dim {args.dim} --chunk {args.chunk} "
             f"--writers {args.writers} --repeat {args.repeat} --where {' '.join(args.where)}{' --pixels' if args.pixels else ''}"
             f"{' --png' if args.png else ''}`: {args.items:,} "
             + ("adopted items whose 1 x 28 x 28 images are PNG files beside the store, read by URI for each chunk"
                if args.png else "ingested items (their 1 x 28 x 28 uint8 images kept in the store and read back "
                                 "for each chunk)" if args.pixels else "features-only items")
             + f" with features of dimension {args.dim}, chunks of {args.chunk}, the second half of the chunks by "
             f"{args.writers} writers at once. Each figure is the median of {args.repeat} runs of each layout (a process "
             "each, alternating which layout runs first). Seconds per step (lower is better), lance/parts the ratio "
             "(below 1: Lance faster).", ""]
    for where in args.where:
        pair = {backend: _median_run([r for r in results if r["where"] == where and r["backend"] == backend])
                for backend in ("parts", "lance") if any(r["backend"] == backend and r["where"] == where
                                                         for r in results)}
        if len(pair) < 2:
            continue
        parts, lance = pair["parts"], pair["lance"]
        lines += [f"## {where}", "", "| step | parts (s) | lance (s) | lance/parts |", "|---|---|---|---|"]
        for step in STEPS:
            a, b = parts["seconds"][step], lance["seconds"][step]
            lines.append(f"| {step} | {a:.3f} | {b:.3f} | {b / a:.2f} |")
        for backend in (parts, lance):
            s = backend["seconds"]
            backend["throughput"] = {"1": s["items_1_writer"] / s["chunks_1_writer"],
                                     "n": s["items_n_writers"] / s["chunks_n_writers"]}
        lines += [f"| chunk commit latency, 1 writer (median, s) | {parts['seconds']['latency_1_writer']:.4f} | "
                  f"{lance['seconds']['latency_1_writer']:.4f} | "
                  f"{lance['seconds']['latency_1_writer'] / parts['seconds']['latency_1_writer']:.2f} |",
                  f"| chunk commit latency, {args.writers} writers (median, s) | {parts['seconds']['latency_n_writers']:.4f} | "
                  f"{lance['seconds']['latency_n_writers']:.4f} | "
                  f"{lance['seconds']['latency_n_writers'] / parts['seconds']['latency_n_writers']:.2f} |",
                  f"| chunk throughput, 1 writer (items/s) | {parts['throughput']['1']:.0f} | {lance['throughput']['1']:.0f} | "
                  f"{parts['throughput']['1'] / lance['throughput']['1']:.2f} |",
                  f"| chunk throughput, {args.writers} writers (items/s) | {parts['throughput']['n']:.0f} | "
                  f"{lance['throughput']['n']:.0f} | {parts['throughput']['n'] / lance['throughput']['n']:.2f} |",
                  f"| peak RSS (MB) | {parts['peak_rss_mb']:.0f} | {lance['peak_rss_mb']:.0f} | "
                  f"{lance['peak_rss_mb'] / parts['peak_rss_mb']:.2f} |",
                  f"| bytes stored (MB) | {parts['bytes_stored'] / 1e6:.1f} | {lance['bytes_stored'] / 1e6:.1f} | "
                  f"{lance['bytes_stored'] / parts['bytes_stored']:.2f} |"]
        if "requests" in parts:
            lines.append(f"| HTTP requests | {parts['requests']} | {lance['requests']} | "
                         f"{lance['requests'] / parts['requests']:.2f} |")
        lines += ["", "Throughput rows: the ratio is parts/lance (above 1: parts faster), so every ratio reads "
                  "'how many times the parts layout's cost Lance pays'. Bytes stored: Lance keeps every version until "
                  "`fastfill gallery gc`; the parts layout overwrites in place. The upgrade's own objects (plan, "
                  "chunks) are the same objects on both layouts.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2_000)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each layout at each location, alternating which goes first; medians reported")
    parser.add_argument("--where", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    parser.add_argument("--pixels", action="store_true",
                        help="an ingested gallery: 1 x 28 x 28 uint8 images kept in the store, read back per chunk")
    parser.add_argument("--png", action="store_true",
                        help="an adopted gallery: 1 x 28 x 28 images as PNG files beside the store, read by URI per chunk")
    parser.add_argument("--png-root", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=["parts", "lance"], help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.backend:
        worker(args)
        return 0
    import tempfile

    results, png_roots = [], {}
    with tempfile.TemporaryDirectory(prefix="lance-bench-") as scratch:
        server = None
        env = dict(os.environ)
        if "s3" in args.where:
            from moto.server import ThreadedMotoServer

            env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
            os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            env["AWS_ENDPOINT_URL_S3"] = os.environ["AWS_ENDPOINT_URL_S3"] = f"http://{host}:{port}"
        try:
            for where, backend, repeat in [(w, b, r) for w in args.where for r in range(args.repeat)
                                           for b in (("parts", "lance") if r % 2 == 0 else ("lance", "parts"))]:
                if where == "s3":
                    import boto3

                    bucket = f"bench-{backend}-{repeat}-{os.getpid()}"
                    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"]).create_bucket(Bucket=bucket)
                    uri = f"s3://{bucket}/gallery"
                else:
                    uri = str(Path(scratch) / f"{backend}-{repeat}")
                if args.png and where not in png_roots:  # written once per location, read by both backends
                    png_roots[where] = (f"s3://{bucket}-png/images" if where == "s3" else str(Path(scratch) / "png"))
                    if where == "s3":
                        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"]).create_bucket(
                            Bucket=f"{bucket}-png")
                    started = time.perf_counter()
                    write_pngs(_data(args.items, args.dim, pixels=True)["pixels"], png_roots[where])
                    print(f"{where}: {args.items} PNGs written in {time.perf_counter() - started:.0f} s", flush=True)
                command = [sys.executable, __file__, "--backend", backend, "--uri", uri, "--items", str(args.items),
                           "--dim", str(args.dim), "--chunk", str(args.chunk), "--writers", str(args.writers),
                           *(["--pixels"] if args.pixels else []),
                           *(["--png-root", png_roots[where]] if args.png else [])]
                print(f"{where} {backend}: running", flush=True)
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    print(out.stderr[-3000:], file=sys.stderr)
                    return out.returncode
                result = json.loads(out.stdout.strip().splitlines()[-1])
                result["where"] = where
                results.append(result)
                print(f"{where} {backend}: " + ", ".join(f"{k} {v:.3f}" for k, v in result["seconds"].items()
                                                        if k in STEPS), flush=True)
        finally:
            if server is not None:
                server.stop()
    text = markdown(results, args)
    args.reports.mkdir(parents=True, exist_ok=True)
    name = ("lance_store" if args.items == 100_000 else f"lance_store-{args.items}") + \
        ("-pixels" if args.pixels else "-png" if args.png else "")
    (args.reports / f"{name}.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                                     if k not in ("backend", "uri", "reports")},
                                                            "results": results}, indent=2, default=str) + "\n")
    (args.reports / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
