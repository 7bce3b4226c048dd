"""What the commands that have nothing to do cost: `fastfill status`, `fastfill upgrade abort` and
`fastfill gallery rollback` on a gallery with no upgrade in progress and none to roll back (and on
a store that holds no gallery), each in a fresh process, timed by the CPU time the process and
its children used (user + system) and by wall time, medians of ``--repeat`` runs. None of them
may start a Prefect server or load torch for that answer.

    .venv/bin/python benchmarks/quick_commands.py [--store PATH] [--repeat 3]

``--store``: a gallery with no upgrade in progress (after `fastfill run` and `fastfill gallery
ingest`, the default store); a store without one is measured as well.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FASTFILL = str(ROOT / ".venv" / "bin" / "fastfill")
COMMANDS = {"status": ["status"], "upgrade abort": ["upgrade", "abort"], "gallery rollback": ["gallery", "rollback"]}


def measure(args: list[str]) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, exit code) of one run of ``fastfill args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([FASTFILL, *args], cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "PREFECT_API_URL": ""}, timeout=300)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=None, help="a gallery with nothing to undo (default: gallery.store)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    empty = tempfile.mkdtemp(prefix="fastfill-no-gallery-")
    stores = {"no gallery": empty}
    if args.store or (ROOT / "gallery").exists():
        stores["a gallery, nothing to undo"] = args.store or str(ROOT / "gallery")
    lines = ["| command | store | exit | CPU s (median) | wall s (median) |", "|---|---|---|---|---|"]
    for store_name, store in stores.items():
        for name, command in COMMANDS.items():
            runs = [measure([*command, "--store", store]) for _ in range(args.repeat)]
            cpu, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            lines.append(f"| fastfill {name} | {store_name} | {runs[-1][2]} | {cpu:.2f} | {wall:.2f} |")
            print(lines[-1], flush=True)
    print(f"\n{sys.argv[0]} --repeat {args.repeat} on {os.cpu_count()} cores\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
