"""The registry watcher: polls the model registry in a thread and starts the upgrade deployment
when `challenger` names a version the gallery is not on or moving to (flows/deployments.py,
``watch_once``)."""

from __future__ import annotations

import json
import threading

from fastfill.components.platform.config import Params
from fastfill.flows.deployments import POLL_DEPLOYMENT, watch_once


class RegistryWatcher:
    """Polls the registry every ``interval`` seconds in a thread of `fastfill serve` (or `fastfill
    watch --every`): each tick is ``watch_once``, plain client calls, so a registry where nothing
    changed costs one alias read and one manifest read a minute and no Prefect flow run. While the
    deployment ``registry-watcher/poll`` is paused (in the Prefect UI), the ticks check nothing.
    A tick that fails (the registry or the store unreachable, no upgrade deployment) is logged and
    the next one tries again."""

    def __init__(self, params: Params, params_path: str, store_uri: str, interval: float, *,
                 pause_deployment: str | None = POLL_DEPLOYMENT, say=None):
        self.params, self.params_path, self.store_uri, self.interval = params, params_path, store_uri, interval
        self.pause_deployment = pause_deployment
        self.say = say or _print
        self.ticks = 0  # checks made (paused ticks are not counted)
        self.last: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said: str | None = None

    def paused(self) -> bool:
        """Whether the poll deployment is paused; a Prefect API without it counts as not paused."""
        if not self.pause_deployment:
            return False
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        try:
            with get_client(sync_client=True) as client:
                return bool(client.read_deployment_by_name(self.pause_deployment).paused)
        except ObjectNotFound:
            return False

    def tick(self) -> dict:
        """One check now (nothing when paused)."""
        if self.paused():
            return {"started": False, "paused": True, "reason": f"the deployment {self.pause_deployment} is paused"}
        result = watch_once(self.params, self.store_uri, self.params_path, say=self.say)
        self.ticks += 1
        self.last = result
        if result.get("started") or result.get("resumed") or result["reason"] != self._said:
            # a started upgrade, and each new reason, once: not a line a minute for nothing
            self._said = result.get("reason")
            self.say(f"registry watcher: {json.dumps(result)}")
        return result

    def run(self, delay: float = 0.0) -> None:
        """Check every ``interval`` seconds, the first after ``delay``, until ``stop``."""
        if self._stop.wait(delay):
            return
        while True:
            try:
                self.tick()
            except Exception as error:  # noqa: BLE001 - a watcher keeps watching; the next tick tries again
                self.say(f"registry watcher: this check failed ({type(error).__name__}: {error}); trying again in "
                         f"{self.interval:g} s")
            if self._stop.wait(self.interval):
                return

    def start(self, delay: float = 0.0) -> RegistryWatcher:
        self._thread = threading.Thread(target=self.run, args=(delay,), name="registry-watcher", daemon=True)
        self._thread.start()
        return self

    def alive(self) -> bool:
        """Whether the polling thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, wait: float = 5.0) -> None:
        """Stop polling; a check in progress gets ``wait`` seconds (a daemon thread: one blocked
        on a registry that does not answer does not keep the process alive)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait)


def _print(message: str) -> None:
    print(message, flush=True)
