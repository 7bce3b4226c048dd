"""What a ranged read costs on moto's S3 server, the S3 of every S3 figure in reports/: a whole
small object against the same bytes as a range of a large one.

    .venv/bin/python benchmarks/moto_ranges.py

The Lance table reads a part's rows as ranges of its data files (tens of MB each); the parts
layout reads whole part objects. On real S3 a range costs about what a small object costs; this
measures whether moto does the same, so that the table's S3 figures can be read. Printed as
milliseconds per request (median of ``--repeat`` requests each), side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-mb", type=int, default=80, help="the large object's size (a table's data file)")
    parser.add_argument("--read-kb", type=int, default=784, help="what one read fetches (a part of 1,000 images)")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)
    from moto.server import ThreadedMotoServer

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        import boto3

        host, port = server.get_host_and_port()
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
        client.create_bucket(Bucket="ranges")
        size = args.read_kb * 1000
        client.put_object(Bucket="ranges", Key="big", Body=os.urandom(args.big_mb << 20))
        client.put_object(Bucket="ranges", Key="small", Body=os.urandom(size))
        start = (args.big_mb << 20) // 2

        def timed(**request) -> float:
            began = time.perf_counter()
            client.get_object(Bucket="ranges", **request)["Body"].read()
            return 1000 * (time.perf_counter() - began)

        rows = {"a whole object of the read's size": [timed(Key="small") for _ in range(args.repeat)],
                f"the same size as a range of a {args.big_mb} MB object":
                    [timed(Key="big", Range=f"bytes={start}-{start + size - 1}") for _ in range(args.repeat)],
                f"4 KB as a range of the {args.big_mb} MB object":
                    [timed(Key="big", Range=f"bytes={start}-{start + 4095}") for _ in range(args.repeat)]}
    finally:
        server.stop()
    first = statistics.median(next(iter(rows.values())))
    print(f"| read ({args.read_kb} KB unless said) | ms (median of {args.repeat}) | x whole object |")
    print("|---|---|---|")
    for name, times in rows.items():
        print(f"| {name} | {statistics.median(times):.1f} | {statistics.median(times) / first:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
