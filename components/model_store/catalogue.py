"""A team's models in the registry: register one from its source (a run of its own, a version,
its alias) and read back what each version is (source, embedding size, input, head), from the
version's tags where it has them, else from its description."""

from __future__ import annotations

from dataclasses import dataclass

from fastfill.components.model_store.preprocessing import Preprocessing

# what `model list` shows without downloading a version's files
TAG_SOURCE, TAG_DIM, TAG_INPUT, TAG_HEAD = ("fastfill.source", "fastfill.embedding_dim", "fastfill.input",
                                            "fastfill.head")


def version_tags(description: dict) -> dict[str, str]:
    """The tags that summarise an embedder's description on its version."""
    from fastfill.components.model_store.artifact import preprocessing_of

    preprocessing = preprocessing_of(description)
    tags = {TAG_SOURCE: description.get("source", "fastfill"), TAG_DIM: str(description.get("embedding_dim", "")),
            TAG_HEAD: str(description.get("head") or "none")}
    if preprocessing is not None:
        tags[TAG_INPUT] = preprocessing.describe()
    return tags


def register(client, experiment_id: str, source, name: str, alias: str | None, *, origin: str) -> str:
    """``source`` (``components.model_store.sources.Source``, already probed) as a new version of
    ``name`` from a run of its own named after ``origin`` (the file or URI it came from)."""
    from fastfill.components.model_store import registered

    run = client.create_run(experiment_id, run_name=f"register {name}", tags={"fastfill.stage": "model-register"})
    try:
        client.log_param(run.info.run_id, "source", source.description["source"])
        client.log_param(run.info.run_id, "origin", origin[:500])
        client.log_param(run.info.run_id, "embedding_dim", source.embedder.embedding_dim)
        client.log_param(run.info.run_id, "preprocessing", source.embedder.preprocessing.describe()[:500])
        version = registered.register_source(client, run.info.run_id, source, name, alias,
                                             {**version_tags(source.description), "fastfill.origin": origin[:500]})
    except BaseException:
        client.set_terminated(run.info.run_id, "FAILED")
        raise
    client.set_terminated(run.info.run_id, "FINISHED")
    return version


@dataclass(frozen=True)
class VersionSummary:
    version: str
    aliases: tuple[str, ...]
    source: str
    embedding_dim: str
    input: str
    head: str
    created: int

    def to_dict(self) -> dict:
        return {"version": self.version, "aliases": list(self.aliases), "source": self.source,
                "embedding_dim": self.embedding_dim, "input": self.input, "head": self.head}


def summaries(client, name: str) -> list[VersionSummary]:
    """Every version of ``name``, newest first."""
    from fastfill.components.model_store import registered

    versions = client.search_model_versions(f"name = '{name}'")
    aliases: dict[str, list[str]] = {}
    for alias, version in client.get_registered_model(name).aliases.items():
        aliases.setdefault(str(version), []).append(alias)
    out = []
    for version in sorted(versions, key=lambda v: int(v.version), reverse=True):
        tags = dict(version.tags)
        if TAG_SOURCE not in tags:  # registered before the tags existed: read its description
            try:
                described = registered.description(f"models:/{name}/{version.version}")
            except Exception:  # noqa: BLE001 - a version that cannot be read is listed as such
                described = None
            tags = version_tags(described) if described else {TAG_SOURCE: "unknown (not written by this product)"}
        out.append(VersionSummary(str(version.version), tuple(sorted(aliases.get(str(version.version), []))),
                                  tags.get(TAG_SOURCE, "?"), tags.get(TAG_DIM, "?"), tags.get(TAG_INPUT, "?"),
                                  tags.get(TAG_HEAD, "?"), int(version.creation_timestamp or 0)))
    return out


IMAGENET = {"channels": 3, "height": 224, "width": 224, "resize": "shorter_then_crop", "resize_to": 256,
            "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def preprocessing_from_options(preset: str | None, channels: int | None, size: str | None, resize: str | None,
                               resize_to: int | None, mean: str | None, std: str | None,
                               interpolation: str | None) -> Preprocessing:
    """The preprocessing a command's options describe: a preset (``imagenet``) with any option
    overriding it; without a preset, --size and --channels are needed. A ValueError names the
    option that is wrong."""
    base: dict = dict(IMAGENET) if preset == "imagenet" else {}
    if preset not in (None, "imagenet"):
        raise ValueError(f"--preset {preset!r}: the preset is imagenet (or none: give --size and --channels)")
    if size:
        try:
            sides = [int(x) for x in size.lower().replace("x", ",").split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--size {size!r}: give HEIGHT,WIDTH or one number for a square") from None
        if len(sides) not in (1, 2) or min(sides) < 1:
            raise ValueError(f"--size {size!r}: give HEIGHT,WIDTH or one number for a square")
        base["height"], base["width"] = sides[0], sides[-1]
        if preset == "imagenet" and resize_to is None:
            base.pop("resize_to", None)
    if channels is not None:
        base["channels"] = channels
    if resize is not None:
        base["resize"] = resize.replace("-", "_")
        if base["resize"] == "stretch":
            base.pop("resize_to", None)
    if resize_to is not None:
        base["resize_to"] = resize_to
    if interpolation is not None:
        base["interpolation"] = interpolation
    for key, text in (("mean", mean), ("std", std)):
        if text is not None:
            try:
                base[key] = tuple(float(x) for x in text.split(","))
            except ValueError:
                raise ValueError(f"--{key} {text!r}: give numbers separated by commas") from None
    missing = [f"--{key}" for key in ("size", "channels") if (key == "size" and "height" not in base)
               or (key == "channels" and "channels" not in base)]
    if missing:
        raise ValueError(f"the model's input is not known: give {' and '.join(missing)} (or --preset imagenet)")
    if "mean" not in base:
        base["mean"], base["std"] = (0.0,), base.get("std", (1.0,))
    from pydantic import ValidationError

    try:
        return Preprocessing(**base)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "preprocessing"
        raise ValueError(f"preprocessing {where}: {first['msg']}") from None
