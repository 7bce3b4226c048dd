"""The services' sections of params.yaml: MLflow's tracking store and model registry (``mlflow``),
and what starts upgrades by itself (``triggers``: the registry watcher, the webhook receiver, the
schedules of `fastfill serve`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from fastfill.components.platform.config_base import PositiveFloat, PositiveInt, Section, _without_password


class MlflowConfig(Section):
    tracking_uri: str = Field(
        default="sqlite:///mlruns.db", description="overridden by MLFLOW_TRACKING_URI when set"
    )

    @field_validator("tracking_uri", "registry_uri", mode="before")
    @classmethod
    def _password_taken(cls, value: object) -> object:
        return _without_password(value)

    registry_uri: str | None = Field(
        default=None, description="the model registry, where it is not the tracking store; null = the tracking URI. "
        "Overridden by MLFLOW_REGISTRY_URI when set")
    artifact_location: str = Field(
        default="mlartifacts", description="a local store's artifact folder (a tracking server keeps its own)")
    experiment: str = Field(default="fastfill", description='the MLflow experiment of every run')
    registered_model: str = Field(
        default="embedder", description='the registered model of the embedding models (aliases champion, challenger)')
    alignment_model: str = Field(
        default="embedder-alignment", description="the registered model of the alignment maps; by default "
        "<registered_model>-alignment (icon-embedder's maps are icon-embedder-alignment)")
    allow_pickled_models: bool = Field(
        default=False, description="load registry versions stored as pickled modules (an older format): "
        "loading a pickle runs its code, so only for a registry whose writers you trust")

    @model_validator(mode="before")
    @classmethod
    def _alignment_model_follows(cls, data):
        """Without alignment_model, the maps are registered beside the embedder: <name>-alignment."""
        if isinstance(data, dict) and "alignment_model" not in data and data.get("registered_model"):
            data = {**data, "alignment_model": f"{data['registered_model']}-alignment"}
        return data


class TriggerConfig(Section):
    """What starts upgrades by itself (`fastfill serve`, `fastfill webhook`): a registry watcher
    polling for a new challenger, MLflow registry webhooks, and schedules."""

    poll_seconds: PositiveInt = Field(default=60, description="the registry watcher's interval")
    webhook_host: str = Field(default="127.0.0.1", description="the webhook receiver listens here only")
    webhook_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        default=8787, description="the webhook receiver's port")
    webhook_secret_env: str = Field(default="FASTFILL_WEBHOOK_SECRET",
                                    description="environment variable holding the webhook's HMAC secret")
    max_clock_skew_seconds: PositiveInt = Field(default=300, description="older signed deliveries are refused")
    webhook_max_body_bytes: PositiveInt = Field(
        default=1 << 20, description="a larger declared body is refused with 413 before any of it is read")
    webhook_rate_per_minute: PositiveFloat = Field(
        default=60, description="POSTs per minute per client address after the burst; more get 429 + Retry-After")
    webhook_burst: PositiveInt = Field(default=10, description="POSTs a client address may send at once")
    webhook_read_timeout_seconds: PositiveFloat = Field(
        default=10, description="a request whose next bytes take longer is dropped (408 while reading the body)")
    nightly_cron: str | None = Field(default="0 2 * * *", description="check-and-upgrade; null = none")
    comparison_cron: str | None = Field(default=None, description="re-run the comparison of every method (hours of "
                                       "training on the gallery's host), e.g. '0 3 * * 0'; null (default): none")
    timezone: str = Field(default="UTC", description="of the cron schedules: an IANA name such as Europe/Paris "
                          "(daylight saving followed)")

    @model_validator(mode="after")
    def _known_timezone(self) -> TriggerConfig:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timezone: {self.timezone!r} is not an IANA time zone; use a name such as UTC, "
                             "Europe/Paris or America/New_York") from None
        return self
