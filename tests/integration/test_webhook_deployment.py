"""A valid webhook delivery when the Prefect server has no upgrade deployment: the receiver (its
own process, `fastfill webhook serve`) answers 503 with a message that names the deployment and
the command that creates it, and releases the version's claim so MLflow's retry can start it."""

import os
import time
from pathlib import Path

from fastfill.components.gallery.store import LocalStore
from fastfill.components.gallery.triggers.claims import claimed
from tests.unit.test_webhook_receiver import _alias_body, _post, _signed, receiver_process


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _deliver_twice(address):
    """The same signed delivery twice, as MLflow retries a 503; both answers."""
    body = _alias_body("7")
    headers = _signed(body, "delivery-no-deployment")
    return [_post(address, headers, body, timeout=180) for _ in range(2)]


def test_a_missing_deployment_on_the_prefect_server_is_named(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()  # the harness's server, which has no deployments
    assert url
    with receiver_process(tmp_path, {**os.environ, "PREFECT_API_URL": url}) as (process, address):
        answers = _deliver_twice(address)
    for status, _, reply in answers:  # a failed start is not remembered: the retry is tried again
        assert status == 503, reply
        assert reply["error"] == ("could not start the upgrade: the deployment upgrade-gallery/upgrade does not exist "
                                  f"on the Prefect server at {url}; create it by running `fastfill serve` with "
                                  f"PREFECT_API_URL={url} (it serves every deployment; keep it running), or put it on a "
                                  "work pool with `fastfill deploy --pool NAME` and start a worker there")
    assert claimed(LocalStore(tmp_path / "gallery"), "embedder", "7") is None  # released for the next try
    assert "does not exist on the Prefect server" in (tmp_path / "webhook.log").read_text()


def test_a_receiver_without_prefect_api_url_says_so(tmp_path):
    """Without PREFECT_API_URL Prefect starts a temporary server of its own, which has no
    deployments: the usual way to meet this, and the answer says what to set."""
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    with receiver_process(tmp_path, env) as (process, address):
        status, _, reply = _deliver_twice(address)[1]
        children = _children(process.pid)  # the temporary Prefect server among them
    # stopped with SIGTERM (what receiver_process sends, as a service manager does), the receiver
    # stops its temporary server too: nothing is left running
    assert children, "the receiver started no temporary Prefect server"
    deadline = time.monotonic() + 20
    while (left := [pid for pid in children if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left]
    assert status == 503, reply
    assert reply["error"] == (
        "could not start the upgrade: the deployment upgrade-gallery/upgrade does not exist on the temporary "
        "Prefect server this process started for itself, because PREFECT_API_URL is not set; set PREFECT_API_URL "
        "to the Prefect server where `fastfill serve` runs (it serves every deployment) and restart this process")
