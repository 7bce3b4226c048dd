"""What every part of the configuration builds on: the ``Section`` every section derives from
(unknown keys are errors, values are frozen), the constrained numbers the sections share, and the
check that takes a server URI's password out before the configuration holds it.

The parts (config_pipeline, config_evaluation, config_gallery, config_services) import this
module and none of one another, except config_evaluation, which names config_pipeline's methods
(align, compatible); config.py puts them together into ``Params``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from fastfill.components.platform.secrets import take_password

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _without_password(value: object) -> object:
    """A server URI's password taken out (``secrets.take_password``: the connection gets it from
    this process's memory), so the configuration, and every record made of it (Prefect's flow
    parameters, MLflow's params, the gallery's manifest), never holds one. Never fails: what is
    not text is left to the field's own check, which then shows no URI."""
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode()
        except UnicodeDecodeError:
            return value
    return take_password(value) if isinstance(value, str) else value
