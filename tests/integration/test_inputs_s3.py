"""A team's files live in its bucket: `fastfill gallery adopt` takes the manifest and the feature
shards as s3:// URIs (moto's S3 server over HTTP) as it takes local paths, and the images the
manifest names relative to itself are read beside it in the bucket."""

import io

import boto3
import numpy as np
import yaml

from fastfill.components.gallery.layouts.catalog import PartsGallery
from fastfill.components.gallery.store import open_store
from tests.environment import new_bucket
from tests.integration.helpers import registry_models, split_images


def test_the_manifest_and_features_are_read_from_s3(upgrade_env, prefect_harness, s3_endpoint):
    from PIL import Image
    from typer.testing import CliRunner

    from fastfill.cli import app

    base, tmp_path = upgrade_env
    _client, old_model, *_ = registry_models(base)
    split = split_images(base)
    images = split.images[:12]
    bucket = new_bucket(s3_endpoint)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    names = []
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        Image.fromarray(image[0], mode="L").save(buffer, format="PNG")
        names.append(f"photos/item-{i}.png")
        s3.put_object(Bucket=bucket, Key=f"team/{names[-1]}", Body=buffer.getvalue())
    manifest = "id,uri\n" + "".join(f"sku-{i},{name}\n" for i, name in enumerate(names))
    s3.put_object(Bucket=bucket, Key="team/manifest.csv", Body=manifest.encode())
    features = np.random.default_rng(0).standard_normal((len(images), old_model.embedding_dim)).astype(np.float32)
    buffer = io.BytesIO()
    np.save(buffer, features)
    s3.put_object(Bucket=bucket, Key="team/features/part-0.npy", Body=buffer.getvalue())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(base.model_dump(mode="json")))
    store = str(tmp_path / "adopted")
    common = ["--store", store, "--params", str(tmp_path / "params.yaml")]
    runner = CliRunner()

    missing = runner.invoke(app, ["gallery", "adopt", "--manifest", f"s3://{bucket}/team/nothing.csv", *common])
    assert missing.exit_code == 6, missing.output
    assert f"--manifest s3://{bucket}/team/nothing.csv does not exist; upload it or fix --manifest" in missing.output
    assert "Traceback" not in missing.output

    adopted = runner.invoke(app, ["gallery", "adopt", "--manifest", f"s3://{bucket}/team/manifest.csv",
                                  "--features", f"s3://{bucket}/team/features/part-0.npy", *common])
    assert adopted.exit_code == 0, adopted.output
    gallery = PartsGallery(open_store(store))
    assert gallery.num_items == len(images)
    np.testing.assert_array_equal(gallery.all_features(gallery.model), features)
    assert gallery.ids().tolist() == [f"sku-{i}" for i in range(len(images))]
    # the relative URIs are read beside the manifest, in the bucket
    assert gallery.image_root == f"s3://{bucket}/team"
    assert gallery.items().column("image").to_pylist()[:2] == names[:2]
