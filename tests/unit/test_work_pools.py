"""Where `fastfill deploy` puts each deployment (services/work_pools.py), without a server: the
training on the GPU pool, the registry checks on the other, a module-path entrypoint that the
worker imports from the installed package, and a working directory for process pools only."""

from pathlib import Path

from fastfill.components.platform.config import load_params
from fastfill.flows.deployments import deployments
from fastfill.services.work_pools import Placement, placer, worker_folder

PARAMS = Path(__file__).resolve().parents[2] / "params.yaml"


def _by_name(placement: Placement, kinds: dict, working_dir: str | None = "/srv/fastfill") -> dict:
    params = load_params(PARAMS)
    scheduled = params.model_copy(update={"triggers": params.triggers.model_copy(
        update={"comparison_cron": "0 3 * * 0", "nightly_cron": "0 2 * * *"})})
    found = deployments(scheduled, "/srv/fastfill/params.yaml", None, placer(placement, kinds, working_dir))
    return {f"{d.flow_name}/{d.name}": d for d in found}


def test_the_training_goes_to_the_gpu_pool_and_the_checks_to_the_other():
    placement = Placement("cpu", "gpu", {"env": {"A": "1"}}, {"env": {"FASTFILL_DEVICE": "cuda"}})
    found = _by_name(placement, {"cpu": "process", "gpu": "docker"})
    assert {name: d.work_pool_name for name, d in found.items()} == {
        "upgrade-gallery/upgrade": "gpu", "comparison/weekly": "gpu",
        "registry-watcher/poll": "cpu", "registry-watcher/nightly": "cpu"}
    # a process pool's runs start in the given folder; a Docker pool's in the image's
    assert found["registry-watcher/poll"].job_variables == {"env": {"A": "1"}, "working_dir": "/srv/fastfill"}
    assert found["upgrade-gallery/upgrade"].job_variables == {"env": {"FASTFILL_DEVICE": "cuda"}}
    assert found["upgrade-gallery/upgrade"].entrypoint == "fastfill.flows.deployments.upgrade_entry"
    assert found["comparison/weekly"].entrypoint == "fastfill.flows.deployments.comparison_entry"
    assert found["upgrade-gallery/upgrade"].parameters == {"params_path": "/srv/fastfill/params.yaml"}


def test_without_a_gpu_pool_everything_goes_to_the_one_pool():
    found = _by_name(Placement("only", job_variables={"working_dir": "/given"}), {"only": "process"})
    assert {d.work_pool_name for d in found.values()} == {"only"}
    assert all(d.job_variables == {"working_dir": "/given"} for d in found.values())  # a given one is kept


def test_the_default_working_directory_is_the_folder_of_the_file_on_the_worker():
    assert worker_folder("/srv/fastfill/params.yaml") == "/srv/fastfill"
    assert worker_folder("params.yaml") is None  # relative: Prefect's default, or the image's folder
