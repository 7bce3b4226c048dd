"""benchmarks/team_upgrade.py's proof that a team's commands read nothing outside the scratch
folder: the paths of strace -f -y lines (pure functions, tested by
tests/unit/test_team_upgrade_script.py) and every step's log checked against the watched roots.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# project outputs a team's commands must never touch (the first two: the brief's hard rule)
MUST_NOT_READ = ("data", "artifacts")
ALSO_WATCHED = ("mlruns.db", "mlartifacts", "gallery")
MUST_NOT_READ_ROOTS = {f"project {d}" for d in MUST_NOT_READ} | {"tiny models"}
STRACE_FILTER = "trace=%file"

# strace -y: "1234 openat(AT_FDCWD</cwd>, "rel/path", O_RDONLY) = 3</abs/path>" and the like
_STRACE_LINE = re.compile(r"^(?:\[pid\s+)?(\d+)\]?\s+(?:<\.\.\. )?(\w+)(?: resumed>)?\(?(.*)$")
_PATH_ARG = re.compile(r'(?:(AT_FDCWD|-?\d+)(?:<([^>]*)>)?,\s*)?"((?:[^"\\]|\\.)*)"')
_RESULT = re.compile(r"=\s+(-?\d+)(?:<([^>]*)>)?(?:\s+(E[A-Z]+))?")


def strace_paths(line: str) -> tuple[str, list[str], str] | None:
    """(system call, the absolute paths it named, "ok" or the errno) of one strace -f -y line;
    None for a line that names no path (signals, exits, unfinished halves without a path)."""
    m = _STRACE_LINE.match(line)
    if not m:
        return None
    call, rest = m[2], m[3]
    paths: list[str] = []
    args = _PATH_ARG.search(rest)
    if args:
        base, path = args[2], args[3].encode().decode("unicode_escape", errors="replace")
        if path.startswith("/"):
            paths.append(os.path.normpath(path))
        elif path == "" and base:  # newfstatat(3</x>, "", ..., AT_EMPTY_PATH)
            paths.append(os.path.normpath(base))
        elif base:
            paths.append(os.path.normpath(os.path.join(base, path)))
        elif path:
            paths.append(path)  # relative without a known base: kept as it is
    end = rest.rfind(") = ")  # the return value (a path may hold " = ", never the call's own ") = ")
    result = _RESULT.search(rest[end + 1:]) if end >= 0 else None
    if result and result[2]:  # the descriptor returned, resolved by the kernel
        paths.append(os.path.normpath(result[2]))
    status = "ok" if result and not result[3] else (result[3] if result else "unfinished")
    return (call, sorted(set(paths)), status) if paths else None


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def strace_hits(lines, roots: dict[str, str]) -> dict[str, list[dict]]:
    """Per watched root (name -> absolute path), the distinct (path, call, status) that touched
    it, with how many times."""
    found: dict[str, dict[tuple, int]] = {name: {} for name in roots}
    for line in lines:
        parsed = strace_paths(line)
        if parsed is None:
            continue
        call, paths, status = parsed
        for path in paths:
            for name, root in roots.items():
                if under(path, root):
                    key = (path, call, status)
                    found[name][key] = found[name].get(key, 0) + 1
    return {name: [{"path": p, "call": c, "status": s, "count": n} for (p, c, s), n in sorted(hits.items())]
            for name, hits in found.items()}


def check_traces(report: dict, roots: dict[str, str], scratch: Path, keep: bool) -> dict:
    """Each backend's steps' strace logs against the watched roots; the logs are deleted unless
    ``keep``. The distinct paths seen under the scratch folder are counted too: the proof that the
    trace saw the command's own reads."""
    out = {"available": True, "filter": STRACE_FILTER, "roots": roots, "per_step": {}, "must_not_read_hits": 0,
           "scratch_paths_seen": {}}
    for backend, result in report["backends"].items():
        for step in result["steps"]:
            path = step.get("strace")
            if not path or not Path(path).is_file():
                continue
            with open(path, errors="replace") as handle:
                hits = strace_hits(handle, {**roots, "scratch": str(scratch)})
            seen = len({hit["path"] for hit in hits.pop("scratch")})
            out["scratch_paths_seen"][f"{backend}: {step['name']}"] = seen
            hits = {name: found for name, found in hits.items() if found}
            out["per_step"][f"{backend}: {step['name']}"] = hits
            step["outside_reads"] = {name: len(found) for name, found in hits.items()}
            out["must_not_read_hits"] += sum(len(found) for name, found in hits.items() if name in MUST_NOT_READ_ROOTS)
            if not keep:
                Path(path).unlink()
    return out
