"""The Lance table finds its S3 credentials as boto3 does (the AWS SDK's standard chain, which
refreshes them), never from a copy taken when the table opened: a team that signs in with a
profile, SSO or an assumed role sets nothing for the table. Against moto's S3 server."""

import subprocess
import sys
from pathlib import Path

from tests.environment import new_bucket

ROOT = Path(__file__).resolve().parents[2]

WRITE_AND_READ = """
import sys
import lance, pyarrow as pa
from fastfill.components.gallery.layouts.table import storage_options, table_uri
store = sys.argv[1]
options = storage_options(store)
assert not any("key" in name or "token" in name for name in options), options  # nothing copied
lance.write_dataset(pa.table({"position": list(range(5))}), table_uri(store), storage_options=options)
print(lance.dataset(table_uri(store), storage_options=options).count_rows())
"""


def _run(env: dict[str, str], store: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WRITE_AND_READ, store], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_table_uses_a_named_profile_and_no_copied_keys(s3_endpoint, tmp_path):
    import os

    bucket = new_bucket(s3_endpoint)
    credentials = tmp_path / "credentials"
    credentials.write_text("[team]\naws_access_key_id = teamkey\naws_secret_access_key = teamsecret\n")
    config = tmp_path / "config"
    config.write_text("[profile team]\nregion = us-east-1\n")
    env = {key: value for key, value in os.environ.items()
           if key not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(credentials), AWS_CONFIG_FILE=str(config), AWS_PROFILE="team",
               AWS_EC2_METADATA_DISABLED="true")
    done = _run(env, f"s3://{bucket}/galleries/profiled")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "5"

    # the same with no credentials anywhere fails: the profile above is what was used
    env.pop("AWS_PROFILE")
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    refused = _run(env, f"s3://{bucket}/galleries/anonymous")
    assert refused.returncode != 0
    assert "credential" in refused.stderr.lower(), refused.stderr[-2000:]
