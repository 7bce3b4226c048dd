"""The comparison's progress (flows.comparison_progress): every seed's trainings and evaluation
counted from the files their stages write last, only those written since the comparison began,
also when another process writes them; the log lines with done/total, rate and time left, and
the last line; components.platform.progress.following polling a count from a thread that sees
the caller's context."""

import contextvars
import os
import re
import subprocess
import sys
import time

import pytest

from fastfill.components.platform.config import parse_params
from fastfill.components.platform.layout import write_json
from fastfill.components.platform.progress import Progress, following
from fastfill.flows.comparison_progress import comparison_progress, finished_stages, seed_stages
from testkit.tiny_demo import tiny_params

STAGES = ["train-old", "train-new", "align-fct", "align-fastfill", "align-l2_disc", "align-rbt", "align-unified",
          "compatible-bct", "compatible-ract", "evaluate"]


@pytest.fixture
def params(tmp_path):
    data = tiny_params(tmp_path / "images")
    data["compare"]["out"] = str(tmp_path / "runs")
    data["compare"]["seeds"] = [0, 1]
    return parse_params(data)


def _finish(path, when=None):
    write_json(path, {"version": "1"})
    if when is not None:
        os.utime(path, (when, when))


def _wait_for(lines, pattern, timeout=10.0):
    """The newest of ``lines()`` that matches ``pattern``, waiting for one up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in lines() if re.search(pattern, line)]
        if found:
            return found[-1]
        time.sleep(0.01)
    raise AssertionError(f"no line matching {pattern!r} in {timeout} s: {lines()[-5:]}")


def test_each_seed_has_its_trainings_and_its_evaluation_under_its_own_folder(params, tmp_path):
    stages = seed_stages(params, 1)
    assert list(stages) == STAGES
    registry = tmp_path / "runs" / "seed-1" / "artifacts" / "registry"
    assert stages["train-old"] == registry / "models-old.json"
    assert stages["align-unified"] == registry / "align-unified.json"
    assert stages["compatible-ract"] == registry / "compatible-ract.json"
    assert stages["evaluate"] == tmp_path / "runs" / "seed-1" / "reports" / "metrics.json"
    assert set(seed_stages(params, 0).values()).isdisjoint(stages.values())


def test_only_stages_written_since_the_start_count(params):
    files = list(seed_stages(params, 0).values())
    since = time.time() - 10
    assert finished_stages(files, since) == 0  # nothing there yet
    _finish(files[0], when=since - 3600)  # an earlier run's output, to be written again
    _finish(files[1])
    _finish(files[-1])
    assert finished_stages(files, since) == 2


def test_the_log_follows_every_seeds_outputs_written_by_other_processes(params):
    seed0, seed1 = seed_stages(params, 0), seed_stages(params, 1)
    _finish(seed0["evaluate"], when=time.time() - 3600)  # a finished earlier comparison
    lines = []
    with comparison_progress(params, [0, 1], poll=0.02, mode="log", every=0, log=lines.append) as bar:
        assert bar.total == 20
        _wait_for(lambda: lines, r"^comparison of seeds 0, 1: 0/20 stages \(0%\), .*time left unknown$")
        _finish(seed0["train-old"])
        _finish(seed0["train-new"])
        # a seed run side by side: its own process writes its files
        code = "import sys; from fastfill.components.platform.layout import write_json; from pathlib import Path; " \
               "write_json(Path(sys.argv[1]), {'version': '1'})"
        subprocess.run([sys.executable, "-c", code, str(seed1["train-old"])], check=True)
        line = _wait_for(lambda: lines, r": 3/20 stages")
        assert re.fullmatch(r"comparison of seeds 0, 1: 3/20 stages \(15%\), [\d.,]+ (stage/s|s/stage), "
                            r"\d+ s elapsed, about \d+ s left", line), line
        for path in [*list(seed0.values())[2:], *list(seed1.values())[1:]]:
            _finish(path)
    assert re.fullmatch(r"comparison of seeds 0, 1: done, 20/20 stages \(100%\) in \d+ s, [\d.,]+ (stage/s|s/stage)",
                        lines[-1]), lines[-1]
    assert bar.done == 20


def test_a_comparison_that_fails_says_where_it_stopped(params):
    lines = []
    with pytest.raises(RuntimeError, match="seed 1 failed"):
        with comparison_progress(params, [1], poll=60, mode="log", every=60, log=lines.append):
            _finish(seed_stages(params, 1)["train-old"])
            raise RuntimeError("seed 1 failed")
    # the count is read once more at the end, before the last line: the file written counts
    assert re.fullmatch(r"comparison of seed 1: stopped at 1/10 stages \(10%\) in \d+ s, .*", lines[-1]), lines


def test_following_polls_the_count_in_the_callers_context_and_once_more_at_the_end():
    run = contextvars.ContextVar("run", default=None)
    run.set("compare")
    seen, counts = [], iter(range(1000))
    bar = Progress("steps", 1000, unit="step", mode="log", every=0, log=lambda line: seen.append((run.get(), line)))
    with following(bar, lambda: next(counts), poll=0.01):
        _wait_for(lambda: [line for _, line in seen], r"steps: [1-9]")
    polled = bar.done
    bar.close()
    assert polled >= 2 and {where for where, _ in seen} == {"compare"}  # the thread saw the caller's context
    assert seen[-1][1].startswith(f"steps: done, {polled}/1,000 steps")


def test_a_count_that_fails_skips_a_poll_without_stopping_the_work():
    calls = []

    def count():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("folder gone")
        return len(calls)

    bar = Progress("steps", 10, mode="off")
    with pytest.warns(UserWarning, match="could not count what is done"):
        with following(bar, count, poll=0.01):
            while len(calls) < 3:
                time.sleep(0.01)
    assert bar.done == len(calls)
