"""benchmarks/team_upgrade.py's commands: how one runs (timed, under strace when asked, never
raising for its failure) and what it printed, read as numbers (pure functions, tested by
tests/unit/test_team_upgrade_script.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.team_upgrade_strace import STRACE_FILTER

ROOT = Path(__file__).resolve().parents[1]
FASTFILL = ROOT / ".venv" / "bin" / "fastfill"
CALLER_ENV_DROPPED = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "FASTFILL_STORE", "PREFECT_API_URL",
                      "PREFECT_API_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


# ------------------------------------------------------------------------------------------------
# Running a command


def run_command(argv: list[str], cwd: Path, env: dict, timeout: float, trace: Path | None) -> dict:
    """Run ``argv`` (under strace when ``trace`` is a file), timed; never raises for its failure.
    A command past ``timeout`` is ended with its process group (this script started it)."""
    # --seccomp-bpf: only the traced calls stop the process (without it every system call does, and
    # a training thread pool runs many times slower under strace)
    full = (["strace", "-f", "--seccomp-bpf", "-y", "-qq", "-e", STRACE_FILTER, "-o", str(trace)] + argv) if trace else argv
    started = time.perf_counter()
    process = subprocess.Popen(full, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        rc = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        rc = None
    return {"argv": argv, "cwd": str(cwd), "rc": rc, "timed_out": rc is None,
            "seconds": round(time.perf_counter() - started, 2), "stdout": stdout, "stderr": stderr,
            "strace": str(trace) if trace else None}


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CALLER_ENV_DROPPED}
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "200"  # one line per message, not wrapped to a narrow pipe
    return env


# ------------------------------------------------------------------------------------------------
# Parsing what the commands print

_CURVE_ROW = re.compile(r"^\s+(\d+)%\s+([0-9.]+) ± ([0-9.]+)\s+([0-9.]+) ± ([0-9.]+)(?:\s+([0-9.]+))?\s*$")
# the label-free prediction (no labels): one number a row, the agreement with the finished upgrade
_AGREEMENT_ROW = re.compile(r"^\s+(\d+)%\s+([0-9.]+)\s*$")
_RECOMMENDED = re.compile(
    r"recommended stop for a gain below ([0-9.]+) (top-1|agreement) points per 5%: (\d+)% \(([0-9,]+) items "
    r"embedded, ([0-9,]+) not\); predicted (?:top-1|agreement) ([0-9.]+)%? there"
    r"(?:, ([0-9.]+)%? at 100% \(([0-9.]+) points given up\))?")
_OUTCOME = re.compile(r"^([a-z][a-z -]*): (\d+) of (\d+) items backfilled \(([0-9.]+)%\) in (\d+) s; MLflow run (\S+)")
_ADVISED = re.compile(r"^budget advisor: recommended stop for a gain below ([0-9.]+) (top-1|agreement) points per 5% "
                      r"is (\d+)% \(predicted (?:top-1|agreement) ([0-9.]+)%?, ([0-9.]+)%? at 100%\)(.*)$")
_GATE = re.compile(r"^promotion gate: (passed, champion moved|REJECTED): champion top-1 ([0-9.]+)%?, challenger mean "
                   r"top-1 along the backfill ([0-9.]+)%?, NFR@1 ([0-9.]+)%, gain reached at (never|[0-9]+%)")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_dry_run(text: str) -> dict:
    """The dry run's plan as numbers: items, chunks, the estimated backfill, what the gate and the
    advisor measure against, the predicted curve (points, %: top-1 and mAP, or the label-free
    agreement) and the recommended stop."""
    out: dict = {"curve": []}
    agreement = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("dry run:"):
            out["headline"] = stripped
        elif stripped.startswith("items ") and "chunks of" in stripped:
            m = re.match(r"items ([0-9,]+) in ([0-9,]+) parts; ([0-9,]+) chunks of ([0-9,]+); images (.*)", stripped)
            if m:
                out.update(items=_int(m[1]), parts=_int(m[2]), chunks=_int(m[3]), chunk_size=_int(m[4]),
                           images=m[5])
        elif stripped.startswith("estimated backfill:"):
            m = re.match(r"estimated backfill: ([0-9.]+) (s|h)", stripped)
            if m:
                out["estimated_backfill_seconds"] = float(m[1]) * (3600 if m[2] == "h" else 1)
        elif stripped.startswith("measured on "):
            out["sample_line"] = stripped
        elif stripped.startswith("truth of the gate and the advisor:"):
            out["truth"] = stripped.split(":", 1)[1].strip()
        elif stripped.startswith("map pairs"):
            out["map_pairs"] = stripped.split(":", 1)[1].strip()
        elif stripped.startswith("budget advisor:"):
            out["advisor_note"] = stripped.split(":", 1)[1].strip()
        elif stripped.startswith(("predicted backfill curve", "predicted agreement")):
            out["curve_header"] = stripped
            agreement = stripped.startswith("predicted agreement")
            out["metric"] = "agreement" if agreement else "top1"
        m = _CURVE_ROW.match(line)
        if m:
            out["curve"].append({"fraction": int(m[1]) / 100, "top1": float(m[2]), "top1_se": float(m[3]),
                                 "map": float(m[4]), "map_se": float(m[5])})
        m = _AGREEMENT_ROW.match(line) if agreement else None
        if m:
            out["curve"].append({"fraction": int(m[1]) / 100, "agreement": float(m[2])})
        m = _RECOMMENDED.search(line)
        if m:
            metric = "top1" if m[2] == "top-1" else "agreement"
            out["recommended"] = {"gain_below": float(m[1]), "metric": metric, "fraction": int(m[3]) / 100,
                                  "items": _int(m[4]), "items_saved": _int(m[5]), metric: float(m[6])}
            if m[7] is not None:
                out["recommended"].update({f"{metric}_full": float(m[7]), f"{metric}_given_up": float(m[8])})
    return out


def parse_upgrade(text: str) -> dict:
    """An upgrade command's outcome: state, items done, the advisor's stop, the gate's numbers
    and reasons."""
    out: dict = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        m = _OUTCOME.match(stripped)
        if m:
            out.update(state=m[1], items_done=int(m[2]), items=int(m[3]), percent=float(m[4]),
                       command_seconds=int(m[5]), mlflow_run_id=m[6])
        if stripped.startswith("up-to-date:"):
            out.update(state="up-to-date", message=stripped)
        m = _ADVISED.match(stripped)
        if m:
            metric = "top1" if m[2] == "top-1" else "agreement"
            out["advised"] = {"gain_below": float(m[1]), "metric": metric, "fraction": int(m[3]) / 100,
                              metric: float(m[4]), f"{metric}_full": float(m[5]), "stopped_there": "stopped there" in m[6]}
        m = _GATE.match(stripped)
        if m:
            reasons = []
            for follow in lines[i + 1:]:
                if not follow.startswith("  - "):
                    break
                reasons.append(follow[4:].strip())
            out["gate"] = {"passed": m[1].startswith("passed"), "champion_top1": float(m[2]),
                           "challenger_top1_auc": float(m[3]), "nfr1_percent": float(m[4]),
                           "gain_reached_at": None if m[5] == "never" else int(m[5].rstrip("%")) / 100,
                           "reasons": reasons}
    return out


def parse_json_output(text: str) -> dict | None:
    """The JSON object a command printed on stdout (``upgrade status``), or None."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:text.rfind("}") + 1])
    except json.JSONDecodeError:
        return None


_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::.*)?$")
_FRAME = re.compile(r"/[\w./-]+\.py:\d+ in \w+")


def error_lines(stdout: str, stderr: str, keep: int = 6) -> list[str]:
    """What a failed command said: its ``error:`` lines if any, else its last non-empty lines
    (usage errors come in a box; its frame is dropped)."""
    text = [line.rstrip() for line in (stderr + "\n" + stdout).splitlines()]
    errors = [line for line in text if line.lstrip("│ ").startswith("error:")]
    if errors:
        return errors[-keep:]
    raised = [i for i, line in enumerate(text) if _EXCEPTION.match(line)]
    if raised:  # a traceback (rich draws it in a box): where it was raised, the line, the exception
        last = raised[-1]
        where = [line.strip("│ ").strip() for line in text[:last] if _FRAME.search(line)]
        code = [line.strip("│ ").strip() for line in text[:last] if "❱" in line]
        return ([f"raised at {where[-1]}"] if where else []) + ([code[-1]] if code else []) + [text[last].strip()]
    meaningful = [line.strip("│╭╮╰╯─ ").strip() for line in text]
    return [line for line in meaningful if line][-keep:]
