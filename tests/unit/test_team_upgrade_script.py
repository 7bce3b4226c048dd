"""benchmarks/team_upgrade.py: what it reads from the commands' output (team_upgrade_commands), the
strace check (team_upgrade_strace) and the golden set it writes (team_upgrade_inputs); no command
is run here."""

import numpy as np

from benchmarks.team_upgrade_commands import error_lines, parse_dry_run, parse_upgrade
from benchmarks.team_upgrade_inputs import judged_pairs
from benchmarks.team_upgrade_strace import strace_hits, strace_paths, under

DRY_RUN = """dry run: nothing written. models:/embedder/1 -> models:/embedder/2 on /tmp/g
  items 2,000 in 2 parts; 2 chunks of 1,000; images read by URI
  estimated backfill: 3 s
  truth of the gate and the advisor: the judged queries of /tmp/judgments.csv
  map pairs (when the registry's map must be trained or checked): a sample of the gallery
  predicted backfill curve (from 300 labeled items of 2,000; ± one standard error):
    backfilled   top-1            mAP
        0%       80.10 ± 1.20    60.00 ± 0.90
      100%       85.50 ± 1.00    70.25 ± 0.80
  recommended stop for a gain below 0.1 top-1 points per 5%: 45% (900 items embedded, 1,100 not); predicted top-1 84.90% there, 85.50% at 100% (0.60 points given up)
"""  # noqa: E501 - the output as the command prints it


def test_dry_run_numbers():
    parsed = parse_dry_run(DRY_RUN)
    assert parsed["items"] == 2000 and parsed["chunks"] == 2 and parsed["chunk_size"] == 1000
    assert parsed["estimated_backfill_seconds"] == 3
    assert parsed["truth"].startswith("the judged queries")
    assert [p["fraction"] for p in parsed["curve"]] == [0.0, 1.0]
    assert parsed["curve"][1]["map"] == 70.25
    assert parsed["recommended"] == {"gain_below": 0.1, "metric": "top1", "fraction": 0.45, "items": 900,
                                     "items_saved": 1100, "top1": 84.9, "top1_full": 85.5, "top1_given_up": 0.6}


def test_upgrade_outcome_and_gate():
    text = ("finished: 2000 of 2000 items backfilled (100.0%) in 41 s; MLflow run abc123\n"
            "promotion gate: REJECTED: champion top-1 80.00, challenger mean top-1 along the backfill 79.50, "
            "NFR@1 3.10%, gain reached at never\n  - top-1 never beat the champion's\n  - NFR@1 too high\n")
    parsed = parse_upgrade(text)
    assert parsed["state"] == "finished" and parsed["items_done"] == 2000 and parsed["mlflow_run_id"] == "abc123"
    assert parsed["gate"]["passed"] is False and parsed["gate"]["gain_reached_at"] is None
    assert parsed["gate"]["reasons"] == ["top-1 never beat the champion's", "NFR@1 too high"]
    paused = parse_upgrade(
        "paused: 900 of 2000 items backfilled (45.0%) in 20 s; MLflow run r1\n"
        "budget advisor: recommended stop for a gain below 0.1 top-1 points per 5% is 45% (predicted top-1 84.90, "
        "85.50 at 100%); stopped there: the same command stays there, a --budget goes on\n")
    assert paused["advised"]["fraction"] == 0.45 and paused["advised"]["stopped_there"]


def test_a_rejected_option_is_reported_by_its_message():
    stderr = ("Usage: fastfill upgrade [OPTIONS] COMMAND [ARGS]...\n"
              "╭─ Error ─────────╮\n│ No such option: --judgments │\n╰─────────────────╯\n")
    assert error_lines("", stderr)[-1] == "No such option: --judgments"
    assert error_lines("", "noise\nerror: the gallery has no labels\n") == ["error: the gallery has no labels"]


def test_strace_paths_resolve_relative_and_descriptor_paths():
    lines = [
        '12 openat(AT_FDCWD</work/main>, "data/splits/test.npy", O_RDONLY) = 3</work/main/data/splits/test.npy>',
        '12 newfstatat(AT_FDCWD</s>, "/work/main/artifacts", 0x7ff, 0) = -1 ENOENT (No such file or directory)',
        '13 newfstatat(5</work/main/mlartifacts/1>, "", {st_mode=S_IFDIR}, AT_EMPTY_PATH) = 0',
        '13 openat(AT_FDCWD</s>, "/s/judgments.csv", O_RDONLY) = 4</s/judgments.csv>',
        '14 +++ exited with 0 +++',
    ]
    assert strace_paths(lines[1]) == ("newfstatat", ["/work/main/artifacts"], "ENOENT")
    hits = strace_hits(lines, {"project data": "/work/main/data", "project artifacts": "/work/main/artifacts",
                               "project mlartifacts": "/work/main/mlartifacts", "scratch": "/t"})
    assert [h["path"] for h in hits["project data"]] == ["/work/main/data/splits/test.npy"]
    assert hits["project artifacts"][0]["status"] == "ENOENT"
    assert hits["project mlartifacts"][0]["path"] == "/work/main/mlartifacts/1"
    assert hits["scratch"] == []
    assert not under("/work/main/database", "/work/main/data")


def test_golden_set_is_class_level_and_never_judges_a_query_against_itself():
    ids, labels = np.array([10, 11, 12, 13, 14, 15]), np.array([0, 1, 0, 1, 0, 2])
    rows = judged_pairs(ids, labels, 6, np.random.default_rng(0))
    assert (10, 12) in rows and (10, 14) in rows and (10, 11) not in rows
    assert all(q != r for q, r in rows)
    assert not any(q == 15 for q, _ in rows)  # alone in its class: no relevant item, no row


def test_label_free_prediction_and_a_traceback():
    parsed = parse_dry_run(
        "  predicted agreement with the finished upgrade (label-free: ...):\n  backfilled   agreement\n"
        "      0%       40.00\n    100%      100.00\n"
        "  recommended stop for a gain below 0.1 agreement points per 5%: 95% (190 items embedded, 10 not); "
        "predicted agreement 99.50 there\n")
    assert parsed["metric"] == "agreement" and [p["agreement"] for p in parsed["curve"]] == [40.0, 100.0]
    assert parsed["recommended"]["fraction"] == 0.95 and parsed["recommended"]["agreement"] == 99.5
    stderr = ("│ /work/main/flows/upgrade.py:113 in upgrade_flow                │\n"
              "│ ❱ 113 │   x = advice[\"top1\"]                                  │\n"
              "╰──────────────╯\nKeyError: 'top1'\n12:00:00.000 | INFO | prefect - Stopping temporary server\n")
    assert error_lines("", stderr) == ["raised at /work/main/flows/upgrade.py:113 in upgrade_flow",
                                       "❱ 113 │   x = advice[\"top1\"]", "KeyError: 'top1'"]
