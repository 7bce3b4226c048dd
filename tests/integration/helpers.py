"""Helpers of the integration tests (not fixtures)."""


def registry_models(params):
    """(client, champion model, challenger model, champion version, challenger version)."""
    from components.platform import registry
    from components.experiment import registered

    client, _ = registry.setup(params.mlflow)
    name = params.mlflow.registered_model
    old = client.get_model_version_by_alias(name, "champion")
    new = client.get_model_version_by_alias(name, "challenger")
    return (client, registered.load_model(f"models:/{name}/{old.version}"),
            registered.load_model(f"models:/{name}/{new.version}"), str(old.version), str(new.version))


def split_images(params):
    """The prepared test split."""
    from components.experiment.data import load_split
    from components.platform.layout import Layout

    return load_split(Layout(params.paths).splits, "test")


