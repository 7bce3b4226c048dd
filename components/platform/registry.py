"""MLflow: the experiment, pipeline and stage runs, metrics, and the model registry.

Runs are addressed by id through ``MlflowClient`` (not the fluent active-run stack), so stage
code behaves the same in the CLI process, in Prefect worker threads and under DVC.

Layout: one parent run per pipeline (tag ``fastfill.pipeline_key``: a hash of the params and
the git commit, so the stages of one ``dvc repro`` find the same parent), one child run per
stage. Registry: ``embedder`` versions (network + classifier head) with aliases ``champion``
(old) and ``challenger`` (new); ``embedder-alignment`` versions tagged with the embedder
versions they join.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastfill.components.platform.config import MlflowConfig
from fastfill.components.platform.secrets import redact, with_password
from fastfill.components.platform.vocabulary import CHALLENGER, CHAMPION, ROLE_ALIASES  # noqa: F401 - part of the registry's interface


@dataclass(frozen=True)
class ModelRef:
    """One registered model version."""

    name: str
    version: str
    dim: int | None = None

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    @property
    def key(self) -> str:
        return f"{self.name}-v{self.version}"

    def same_version(self, other: ModelRef) -> bool:
        """Both name one registered version (the dimension left aside)."""
        return (self.name, str(self.version)) == (other.name, str(other.version))

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "dim": self.dim, "uri": self.uri}

    @classmethod
    def from_dict(cls, data: dict) -> ModelRef:
        return cls(data["name"], str(data["version"]), data.get("dim"))

PIPELINE_KEY_TAG = "fastfill.pipeline_key"
STAGE_TAG = "fastfill.stage"


def tracking_uri(config: MlflowConfig) -> str:
    """MLFLOW_TRACKING_URI, else mlflow.tracking_uri (a password written there, taken out when
    params.yaml was read, put back for MLflow's own connection: never shown, ``shown_uri``)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or with_password(config.tracking_uri)


def registry_uri(config: MlflowConfig) -> str:
    """Where the model registry lives: MLFLOW_REGISTRY_URI, else mlflow.registry_uri, else the
    tracking URI (MLflow's own order)."""
    return os.environ.get("MLFLOW_REGISTRY_URI") or (with_password(config.registry_uri) if config.registry_uri
                                                      else tracking_uri(config))


def shown_uri(uri: str) -> str:
    """A store's URI as a record or a message shows it: a relative SQLite path made absolute,
    credentials in a URL left out."""
    if uri.startswith("sqlite:///"):  # sqlite:///relative.db or sqlite:////absolute.db
        return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    if not uri.startswith(("http://", "https://")):
        return redact(uri)  # a database's URI: its password, whatever its characters, left out
    start = uri.index("://") + 3
    at = uri.rfind("@", start)  # the credentials run to the last @, whatever characters a password holds
    return redact(uri[:start] + uri[at + 1:] if at >= 0 else uri)


def identity(config: MlflowConfig) -> str:
    """The registry's identity as a gallery records it (``shown_uri`` of the registry URI)."""
    return shown_uri(registry_uri(config))


# What MLflow logs at INFO while it opens a database store: a new one's tables created ("Creating
# initial MLflow database tables...", "Updating database tables") and alembic's migration lines
STORE_START_LOGGERS = ("mlflow.store.db.utils", "alembic")


def quiet_store_start() -> None:
    """Keep MLflow's start-up lines for a database store (``STORE_START_LOGGERS``) off the
    terminal: they are not a command's answer. Only their INFO lines: warnings and errors still
    show, and a level the user asked of MLflow (MLFLOW_LOGGING_LEVEL) is left as it is. Called
    before the store is first opened, after MLflow's import, which sets its loggers' levels."""
    import mlflow  # noqa: F401 - imported first: its import sets the levels of the loggers below

    if os.environ.get("MLFLOW_LOGGING_LEVEL"):
        return
    for name in STORE_START_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))


def setup(config: MlflowConfig) -> tuple[Any, str]:
    """Point MLflow at the configured store and return (client, experiment id)."""
    import mlflow
    from mlflow import MlflowClient

    quiet_store_start()  # before the client opens (and may create) the store
    global _allow_pickled
    _allow_pickled = config.allow_pickled_models
    uri, models = tracking_uri(config), registry_uri(config)
    # mlflow.set_*_uri also export MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI; left there, that
    # would read as the user's override and pin every later configuration of this process to
    # the first store. Keep the environment as the user set it.
    saved = {key: os.environ.get(key) for key in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(models)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    # the registry named explicitly: a client without one follows MLflow's process-wide
    # registry URI, i.e. whichever store was configured last in this process
    client = MlflowClient(tracking_uri=uri, registry_uri=models)
    experiment = client.get_experiment_by_name(config.experiment)
    if experiment is not None:
        if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return client, experiment.experiment_id
    from mlflow.exceptions import MlflowException

    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
    try:
        return client, client.create_experiment(config.experiment, artifact_location=artifact_location(config, uri),
                                                tags=tags)
    except MlflowException:  # another process created it first
        experiment = client.get_experiment_by_name(config.experiment)
        if experiment is None:
            raise
        return client, experiment.experiment_id


# The MLflow UI opens an experiment of this kind on model training (runs, metrics, models), not on
# GenAI traces
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def artifact_location(config: MlflowConfig, uri: str) -> str | None:
    """Where a new experiment's artifacts go. Against a tracking server (http/https) None: the
    server decides (its proxied ``mlflow-artifacts:`` store, or its default root), so artifacts
    never land on the client's disk. With a local store, ``artifact_location`` (a relative folder
    is resolved against the working directory, as a file: URI)."""
    if uri.startswith(("http://", "https://")):
        return None
    location = config.artifact_location
    return location if "://" in location else Path(location).resolve().as_uri()


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def data_version(directory: Path) -> str:
    """DVC's own hash of a data folder, as dvc.lock records it for a stage's output folder
    (``<md5>.dir``): the md5 of the JSON list of each file's md5 and path relative to the folder,
    sorted by path. A run tagged with it names the dvc.lock entry of the data it used."""
    directory = Path(directory)
    entries = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest = hashlib.md5()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        entries.append({"md5": digest.hexdigest(), "relpath": path.relative_to(directory).as_posix()})
    entries.sort(key=lambda entry: entry["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def pipeline_key(params_text: str, commit: str) -> str:
    return hashlib.sha256((params_text + "\n" + commit).encode()).hexdigest()[:16]


def pipeline_run(client, experiment_id: str, key: str, *, fresh: bool, tags: Mapping[str, str]) -> str:
    """The parent run for this pipeline: a new one when ``fresh``, else the newest with ``key``."""
    if not fresh:
        found = client.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}'",
                                   order_by=["attributes.start_time DESC"], max_results=1)
        if found:
            return found[0].info.run_id
    run = client.create_run(experiment_id, run_name="pipeline", tags={PIPELINE_KEY_TAG: key, **tags})
    return run.info.run_id


def stage_run(client, experiment_id: str, parent_id: str, stage: str, tags: Mapping[str, str]) -> str:
    run = client.create_run(experiment_id, run_name=stage,
                            tags={"mlflow.parentRunId": parent_id, STAGE_TAG: stage, **tags})
    return run.info.run_id


def _flatten(prefix: str, value: object, out: dict[str, str]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = json.dumps(value) if isinstance(value, list | tuple) else str(value)


def log_params(client, run_id: str, params: Mapping[str, object]) -> None:
    from mlflow.entities import Param

    flat: dict[str, str] = {}
    _flatten("", params, flat)
    items = [Param(k, v[:6000]) for k, v in flat.items()]
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=items[start: start + 100])


def metric_time() -> int:
    """Now, as MLflow stamps a metric: milliseconds since the epoch."""
    return int(time.time() * 1000)


def _send_metrics(client, run_id: str, points: Iterable[tuple[str, float | None, int]],
                  timestamp: int | None = None) -> None:
    """(name, value, step) triples in batches; missing and non-finite values are skipped.
    ``timestamp`` (``metric_time``; default now): points sent again with the same timestamp are
    kept once (MLflow's SQL store drops an exact repeat), so a retried write adds nothing."""
    from mlflow.entities import Metric

    now = metric_time() if timestamp is None else timestamp
    items = [Metric(name, float(value), now, step) for name, value, step in points
             if value is not None and math.isfinite(value)]
    for start in range(0, len(items), 500):
        client.log_batch(run_id, metrics=items[start: start + 500])


def log_metrics(client, run_id: str, metrics: Mapping[str, float], step: int = 0,
                timestamp: int | None = None) -> None:
    _send_metrics(client, run_id, ((name, value, step) for name, value in metrics.items()), timestamp)


def log_series(client, run_id: str, series: Mapping[str, Iterable[float]], steps: Iterable[int] | None = None,
               timestamp: int | None = None) -> None:
    """Each named series as one metric; step = position (epochs), or ``steps`` (e.g. a backfill
    curve's backfilled fraction in per mille, so the MLflow chart's x axis reads as the backfill)."""
    steps = None if steps is None else list(steps)
    _send_metrics(client, run_id, ((name, value, step if steps is None else steps[step])
                                   for name, values in series.items() for step, value in enumerate(values)), timestamp)


def log_artifact(client, run_id: str, path: Path, artifact_path: str | None = None) -> None:
    client.log_artifact(run_id, str(path), artifact_path)


def log_json(client, run_id: str, data: object, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(json.dumps(data, indent=2))
        client.log_artifact(run_id, str(path))


def end_run(client, run_id: str, status: str = "FINISHED") -> None:
    client.set_terminated(run_id, status)


@contextmanager
def active(run_id: str):
    """Make ``run_id`` the active run for MLflow APIs that need one (model logging)."""
    import mlflow

    with mlflow.start_run(run_id=run_id):
        yield


PICKLE_OPT_IN = "FASTFILL_ALLOW_PICKLED_MODELS"
_allow_pickled = False  # mlflow.allow_pickled_models, set by setup()


def pickled_models_allowed() -> bool:
    """Whether registry versions stored as pickled modules may be loaded (they run code)."""
    return _allow_pickled or os.environ.get(PICKLE_OPT_IN, "") in ("1", "true", "yes")


class RegistryError(ValueError):
    """A model reference that the registry can't resolve; the message lists what exists."""


def resolve_model(client, uri: str):
    """``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` -> ModelRef (name, concrete version)."""
    from mlflow.exceptions import MlflowException

    if not uri.startswith("models:/") or uri.count("/") < 1:
        raise RegistryError(f"{uri!r} is not a model reference; use models:/NAME@ALIAS or models:/NAME/VERSION")
    rest = uri[len("models:/"):]
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, _, number = rest.partition("/")
            version = client.get_model_version(name, number)
    except MlflowException as error:
        try:
            known = client.get_registered_model(rest.split("@")[0].split("/")[0])
            aliases = ", ".join(f"{a} -> v{v}" for a, v in sorted(known.aliases.items())) or "none"
            hint = f"{known.name} has aliases: {aliases}"
        except MlflowException:
            names = sorted(m.name for m in client.search_registered_models())
            hint = f"registered models: {', '.join(names) or 'none'}"
        raise RegistryError(f"unknown model {uri!r} ({error.error_code}); {hint}") from None
    return ModelRef(version.name, str(version.version))


def find_alignment(client, name: str, old_version: str, new_version: str) -> list:
    """Versions of the alignment model ``name`` tagged as joining the two embedder versions,
    newest first; FastFill (uncertainty) maps before others."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except MlflowException:
        return []
    joins = [v for v in versions if v.tags.get("from_version") == str(old_version)
             and v.tags.get("to_version") == str(new_version)]
    return sorted(joins, key=lambda v: (v.tags.get("method") == "fastfill", int(v.version)), reverse=True)


def _tag_verdict_last(client, name: str, version: str, run_id: str | None, tags: Mapping[str, str]) -> None:
    """Tags one at a time (MLflow has no batch for model versions), the details first and the
    verdict (``promotion``, the key without a dot) last: whoever sees the verdict sees its
    reason, the champion it was measured against, the numbers."""
    for key in sorted(tags, key=lambda k: "." not in k):
        client.set_model_version_tag(name, str(version), key, tags[key])
        if run_id:
            client.set_tag(run_id, key, tags[key])


def record_promotion(client, name: str, version: str, run_id: str | None, tags: Mapping[str, str],
                     promote: bool) -> None:
    """The promotion decision as tags on the model version and the upgrade's run; when
    ``promote``, ``champion`` moves to the version."""
    _tag_verdict_last(client, name, version, run_id, tags)
    if promote:
        client.set_registered_model_alias(name, CHAMPION, str(version))
        # the convention: `challenger` names a version under evaluation; once it is the champion
        # there is none, and the next registered candidate gets the alias
        if alias_version(client, name, CHALLENGER) == str(version):
            client.delete_registered_model_alias(name, CHALLENGER)


def record_rollback(client, name: str, version: str, previous: str, run_id: str | None,
                    tags: Mapping[str, str], *, retried: bool = False) -> bool:
    """A promoted ``version`` rolled back: ``tags`` on it (and on its upgrade's run), and
    ``champion`` back on ``previous`` when it still names ``version`` (a champion moved since by
    someone else is left alone). Returns whether champion moved. ``retried``: an earlier try may
    have moved champion and lost the answer; champion on ``previous`` is then that move."""
    _tag_verdict_last(client, name, version, run_id, tags)
    champion = alias_version(client, name, CHAMPION)
    if retried and champion == str(previous):
        return True
    if champion != str(version):
        return False
    client.set_registered_model_alias(name, CHAMPION, str(previous))
    return True


def alias_version(client, name: str, alias: str) -> str | None:
    """The version an alias points at, or None when the alias (or the model) does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def asked_version(client, name: str, to_uri: str = "") -> ModelRef | None:
    """The version an upgrade is asked for: ``to_uri`` resolved, else ``name``'s challenger;
    None when there is none. A registry without the registered model ``name`` is refused with
    what it holds (RegistryError)."""
    from mlflow.exceptions import MlflowException

    if to_uri:
        return resolve_model(client, to_uri)
    version = alias_version(client, name, CHALLENGER)
    if version is not None:
        return ModelRef(name, version)
    try:
        client.get_registered_model(name)
    except MlflowException:  # no such registered model: refused with what the registry holds
        resolve_model(client, f"models:/{name}@{CHALLENGER}")
        raise
    return None


class TrackingUnreachable(RuntimeError):
    """The MLflow tracking server does not answer; the message names it and what to do."""


def check_tracking_server(config: MlflowConfig, timeout: float = 5.0) -> str:
    """A tracking server (http/https URI) must answer ``GET <uri>/health`` within ``timeout``
    seconds, once, without MLflow's retries; raises TrackingUnreachable otherwise. A local store
    (SQLite, a folder) needs no server. Returns what was found, for a report."""
    uri = tracking_uri(config)
    if not uri.startswith(("http://", "https://")):
        return f"{shown_uri(uri)} (a local store: no server to reach)"
    import requests

    shown = shown_uri(uri)  # without credentials
    insecure = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("1", "true")
    verify = False if insecure else os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True
    todo = ("check that the server is running and that MLFLOW_TRACKING_URI (or mlflow.tracking_uri in params.yaml) "
            "names it, then run the command again")
    started = time.monotonic()
    try:
        answer = requests.get(uri.rstrip("/") + "/health", timeout=timeout, verify=verify)
    except requests.exceptions.Timeout:
        raise TrackingUnreachable(f"the MLflow tracking server at {shown} did not answer within {timeout:g} s; "
                                  f"{todo}") from None
    except requests.exceptions.RequestException as error:
        reason = type(error).__name__
        raise TrackingUnreachable(f"cannot reach the MLflow tracking server at {shown} ({reason}); {todo}") from None
    if answer.status_code >= 500:
        raise TrackingUnreachable(f"the MLflow tracking server at {shown} answered HTTP {answer.status_code}; "
                                  f"{todo}")
    return f"{shown} answered in {time.monotonic() - started:.2f} s"
