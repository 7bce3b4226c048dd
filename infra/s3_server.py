"""The local stack's S3 endpoint: moto's server, with its data kept on disk across restarts.

moto keeps every bucket and object in memory, so a plain `moto_server` forgets the gallery, the
MLflow artifacts and the DVC cache when it stops, while the MLflow database (a file) still points
at them. moto's own persistence is its request recorder (``MOTO_RECORDER_FILEPATH``, switched on
by ``MOTO_ENABLE_RECORDING`` or ``POST /moto-api/recorder/start-recording``): every request is
appended to a log, and a replay of the log rebuilds the state. This server uses it like this:

- only requests that change something are recorded (not GET or HEAD, which would make the log
  grow with every read), one at a time under a lock (moto's server is threaded; two requests
  appending at once could interleave their lines);
- at start, before the endpoint listens, the log is replayed into a private server in this
  process, multipart uploads included (a replayed upload gets a new upload id, which its parts
  are sent with);
- then the log is compacted: the replayed state, every bucket and every object with its
  content type and metadata, is written as a new log of plain PUTs and atomically put in place
  of the old one, so the log holds the live data once, not every write ever made;
- then the endpoint listens on --host/--port with recording on.

    python infra/s3_server.py --host 127.0.0.1 --port 9000 --state infra/.stack/s3

What survives: buckets, objects, their content type, user metadata (x-amz-meta-*), cache
control, content encoding and disposition. What does not: bucket settings (versioning, policies,
CORS, lifecycle), object versions, tags and ACLs, and multipart uploads never completed. A request
cut off by a kill while it was being recorded (the log's last line) is skipped with a warning.
ETags of objects that were uploaded in parts change after a restart (they become the MD5 of the
whole object). Nothing of this is for production: there, S3 or MinIO keeps the data.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

LOG_NAME = "requests.jsonl"
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
DROPPED_HEADERS = {"host", "content-length", "transfer-encoding", "expect", "connection"}
KEPT_OBJECT_HEADERS = {"CacheControl": "Cache-Control", "ContentDisposition": "Content-Disposition",
                       "ContentEncoding": "Content-Encoding", "ContentLanguage": "Content-Language",
                       "ContentType": "Content-Type"}
CREDENTIALS = {"aws_access_key_id": "local-stack", "aws_secret_access_key": "local-stack-secret",
               "region_name": "us-east-1"}


def warn(message: str) -> None:
    print(f"s3_server: {message}", file=sys.stderr, flush=True)


def install_recorder_guard() -> None:
    """Record changes only, one request at a time."""
    from moto.moto_api import recorder

    lock = threading.Lock()
    record = recorder._record_request

    def guarded(request, body=None):
        if request.method.upper() in SAFE_METHODS:
            return None
        with lock:
            return record(request, body)

    recorder._record_request = guarded


def read_log(path: Path) -> list[dict]:
    entries = []
    if not path.is_file():
        return entries
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                warn(f"{path}:{number}: not a whole request (cut off when the server was killed?); skipped")
    return entries


def replay(entries: list[dict], endpoint: str) -> int:
    """Send the recorded requests that change state to ``endpoint``, in their order. A multipart
    upload's parts carry the upload id the original server gave; the replayed upload has a new
    one, so each recorded id is mapped to the next new id created for the same object."""
    import requests

    target = urlsplit(endpoint)
    created: dict[str, deque[str]] = defaultdict(deque)  # object path -> new upload ids not yet mapped
    mapped: dict[str, str] = {}
    failed = 0
    with requests.Session() as session:
        for entry in entries:
            method = entry.get("method", "GET").upper()
            if method in SAFE_METHODS:
                continue
            url = urlsplit(entry["url"])
            query = url.query
            match = re.search(r"(?:^|&)uploadId=([^&]+)", query)
            if match:
                old = match.group(1)
                if old not in mapped and created[url.path]:
                    mapped[old] = created[url.path].popleft()
                query = query.replace(f"uploadId={old}", f"uploadId={mapped.get(old, old)}")
            body = entry.get("body") or b""
            if entry.get("body_encoded"):
                body = base64.b64decode(body)
            headers = {k: v for k, v in (entry.get("headers") or {}).items() if k.lower() not in DROPPED_HEADERS}
            response = session.request(method, urlunsplit((target.scheme, target.netloc, url.path, query, "")),
                                       headers=headers, data=body)
            if method == "POST" and re.search(r"(?:^|&)uploads(?:=|&|$)", url.query) and response.ok:
                upload = re.search(r"<UploadId>([^<]+)</UploadId>", response.text)
                if upload:
                    created[url.path].append(upload.group(1))
            if response.status_code >= 500:
                failed += 1
    return failed


def snapshot(endpoint: str) -> list[dict]:
    """Every bucket and object of the server at ``endpoint`` as requests that recreate them."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **CREDENTIALS)
    entries = []
    for bucket in sorted(b["Name"] for b in client.list_buckets().get("Buckets", [])):
        entries.append({"method": "PUT", "url": f"{endpoint}/{bucket}", "headers": {}, "body": "",
                        "body_encoded": False})
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                found = client.get_object(Bucket=bucket, Key=item["Key"])
                headers = {header: found[field] for field, header in KEPT_OBJECT_HEADERS.items() if found.get(field)}
                headers.update({f"x-amz-meta-{k}": v for k, v in found.get("Metadata", {}).items()})
                entries.append({"method": "PUT", "url": f"{endpoint}/{bucket}/{quote(item['Key'], safe='/~')}",
                                "headers": headers, "body": base64.b64encode(found["Body"].read()).decode("ascii"),
                                "body_encoded": True})
    return entries


def write_log(path: Path, entries: list[dict]) -> None:
    """Atomically: the old log stays whole until the new one is complete on disk."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as handle:
        for entry in entries:
            handle.write(json.dumps(entry) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def restore(log: Path) -> dict:
    """Replay ``log`` into this process's moto state through a private server, then compact it."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    started = time.perf_counter()
    entries = read_log(log)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        failed = replay(entries, endpoint)
        compacted = snapshot(endpoint)
    finally:
        server.stop()
    write_log(log, compacted)
    objects = sum(1 for entry in compacted if entry["body_encoded"])
    return {"replayed": len(entries), "failed": failed, "buckets": len(compacted) - objects, "objects": objects,
            "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--state", type=Path, required=True, help="folder of the request log")
    args = parser.parse_args(argv)

    args.state.mkdir(parents=True, exist_ok=True)
    log = (args.state / LOG_NAME).resolve()
    os.environ["MOTO_RECORDER_FILEPATH"] = str(log)  # read when moto's recorder is created
    os.environ.pop("MOTO_ENABLE_RECORDING", None)     # off while the log is replayed
    for key in ("aws_access_key_id", "aws_secret_access_key"):
        os.environ.setdefault(key.upper(), CREDENTIALS[key])
    from moto.moto_api import recorder

    install_recorder_guard()
    summary = restore(log)
    print(f"s3_server: restored {summary['buckets']} buckets and {summary['objects']} objects from {log} "
          f"({summary['replayed']} recorded requests, {summary['failed']} failed) in {summary['seconds']:.1f} s",
          flush=True)
    recorder.start_recording()

    from moto.server import main as serve

    serve(["-H", args.host, "-p", str(args.port)])


if __name__ == "__main__":
    main()
