"""`fastfill upgrade --progress` in a pseudo-terminal shows the backfill's bar on stderr: on a
terminal nobody sized (0 x 0, where tqdm on its own draws nothing), and for a backfill that is
over before the bar's first poll of the store (the tiny gallery's takes well under a second)."""

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

FASTFILL = str(Path(sys.executable).with_name("fastfill"))


def _run_in_pty(args: list[str], env: dict, cwd: Path, timeout: float = 180) -> tuple[int, str, str]:
    """(exit code, stdout, what the terminal on stderr showed)."""
    main, side = pty.openpty()
    try:
        process = subprocess.Popen([FASTFILL, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=side)
        os.close(side)
        side = None
        shown = bytearray()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the process closed its side (Linux: EIO)
                    break
                if not chunk:
                    break
                shown += chunk
            elif process.poll() is not None:
                break
        stdout = process.communicate(timeout=60)[0].decode()
    finally:
        os.close(main)
        if side is not None:
            os.close(side)
    return process.returncode, stdout, shown.decode(errors="replace")


def test_the_upgrade_shows_its_backfill_bar_in_a_pseudo_terminal(upgrade_env, cli_env, prefect_harness):
    from prefect.settings import get_current_settings

    from fastfill.flows.ingest import ingest_flow
    from tests.integration.helpers import registry_models

    params, tmp_path = upgrade_env
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    _, _, _, old_version, new_version = registry_models(params)
    env = {**cli_env, "PREFECT_API_URL": get_current_settings().api.url}
    for name in ("FASTFILL_PROGRESS", "COLUMNS", "LINES"):
        env.pop(name, None)
    code, stdout, shown = _run_in_pty(["upgrade", "--params", str(tmp_path / "params.yaml"), "--store", uri,
                                       "--progress"], env, tmp_path)
    assert code == 0, stdout + shown[-3000:]
    assert stdout.startswith("complete: 72 of 72 items backfilled (100.0%)"), stdout
    upgrade = f"embedder-v{old_version}-to-embedder-v{new_version}"
    assert f"backfill {upgrade}: 100%|" in shown and "█" in shown and "72/72" in shown, shown[-3000:]
