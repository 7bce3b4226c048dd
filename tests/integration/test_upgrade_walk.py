"""The path of one upgrade reads straight: following the configuration (``params`` and its
sections) from ``upgrade_flow`` through a whole upgrade, every call of the product's functions
that receives it is recorded with the module it comes from. A call into another module enters
that module; a call from a lower layer into a higher one (components -> tasks -> flows) climbs
back up. Few climbs and few entries per module mean a reader follows the upgrade down, not
back and forth."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from fastfill.flows.ingest import ingest_flow
from fastfill.flows.upgrade import upgrade_flow

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"components": 1, "tasks": 2, "flows": 3, "cli": 4, "services": 4}
MAX_CLIMBS, MAX_ENTRIES = 10, 5  # fewer than 10 climbs; no module entered more than 5 times


def _module(filename: str) -> str | None:
    try:
        relative = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if relative.parts[0] not in LAYERS:
        return None
    return ".".join(relative.with_suffix("").parts).removesuffix(".__init__")


def _carries_configuration(frame) -> bool:
    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return any(isinstance(value, BaseModel) and type(value).__module__.startswith("fastfill.components.platform.config")
               for value in (frame.f_locals.get(name) for name in names))


def walk(run) -> tuple[list[tuple[str, str]], object]:
    """(the (caller module, callee module) of every call that receives the configuration and
    crosses into another module, in order; ``run()``'s result), on this thread."""
    crossings: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _module(frame.f_code.co_filename)
        if callee is None or not _carries_configuration(frame):
            return
        caller, back = None, frame.f_back
        while back is not None and caller is None:
            caller = _module(back.f_code.co_filename)
            back = back.f_back
        if caller is not None and caller != callee:
            crossings.append((caller, callee))

    sys.setprofile(profile)
    try:
        result = run()
    finally:
        sys.setprofile(None)
    return crossings, result


def climbs(crossings) -> list[tuple[str, str]]:
    return [(a, b) for a, b in crossings if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]]


def test_following_the_configuration_through_one_upgrade_reads_straight(upgrade_env, prefect_harness):
    params, tmp_path = upgrade_env
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    crossings, result = walk(lambda: upgrade_flow(params, uri))
    assert result.state in ("complete", "rejected")
    assert crossings, "the walk saw the configuration cross modules"
    entries = Counter(callee for _, callee in crossings)
    up = climbs(crossings)
    print(f"{len(crossings)} crossings, {len(up)} climbs, {len(entries)} modules; most entered: "
          f"{entries.most_common(5)}")
    assert len(up) < MAX_CLIMBS, up
    assert max(entries.values()) <= MAX_ENTRIES, entries.most_common(5)
