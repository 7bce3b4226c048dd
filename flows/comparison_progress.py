"""How far `fastfill compare` is: of every seed's stages (the old and the new model, each map,
each compatible model, the evaluation), how many have finished, with the rate and the time left;
a bar on a terminal, a line every FASTFILL_PROGRESS_SECONDS in a log.

The count is read from the seeds' outputs on disk: each stage writes one file last, when it is
done, under compare.out/seed-<s>/. So the same count follows seeds run in this process and seeds
run side by side in processes of their own, which need no channel to the parent but their files.
Only files written since the comparison began count: a rerun writes every stage's file again.
The time left assumes the stages still to run take as long as those done (over several seeds a
fair guess; within one, the models train slower than the maps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fastfill.components.platform.config import Params
from fastfill.components.platform.layout import Layout
from fastfill.components.platform.progress import Progress, following, progress
from fastfill.tasks._policy import log

# a file's time comes from the kernel's coarse clock, up to a few milliseconds behind time.time()
CLOCK_SLACK_SECONDS = 1.0


def seed_stages(params: Params, seed: int) -> dict[str, Path]:
    """The stages of one seed of the comparison, each with the file it writes last: a training's
    registry record (artifacts/registry/<output>.json), the evaluation's metrics.json."""
    seeded = params.for_comparison(seed)
    layout = Layout(seeded.paths)
    stages = {f"train-{role}": layout.registry_record(f"models-{role}") for role in ("old", "new")}
    stages.update({f"align-{method}": layout.registry_record(f"align-{method}") for method in seeded.align})
    stages.update({f"compatible-{method}": layout.registry_record(f"compatible-{method}")
                   for method in seeded.compatible})
    stages["evaluate"] = layout.metrics
    return stages


def finished_stages(files: Iterable[Path], since: float) -> int:
    """How many of ``files`` were written at ``since`` (a ``time.time()``) or later: stages done in
    this comparison, not an earlier run's outputs that it will write again."""
    done = 0
    for path in files:
        try:
            done += path.stat().st_mtime >= since
        except OSError:  # not written yet
            pass
    return done


@contextmanager
def comparison_progress(params: Params, seeds: list[int], *, poll: float, log: Callable[[str], None] = log,
                        mode: str | None = None, every: float | None = None) -> Iterator[Progress]:
    """The progress of ``seeds``' stages while the block runs them, their files counted every
    ``poll`` seconds; ``mode``, ``log`` and ``every`` as in ``components.platform.progress``. A
    block that raises ends with a "stopped at" line."""
    files = [path for seed in seeds for path in seed_stages(params, seed).values()]
    since = time.time() - CLOCK_SLACK_SECONDS
    label = f"comparison of seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
    with progress(label, total=len(files), unit="stage", mode=mode, log=log, every=every) as bar, \
            following(bar, lambda: finished_stages(files, since), poll=poll):
        yield bar
