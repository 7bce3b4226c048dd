"""A chunk's images are read one batch ahead of the model: the same features and failures as
reading everything first, with the next batch's read running while the model embeds this one."""

import threading

import numpy as np

from fastfill.components.gallery.inputs.images import ImageFailure
from fastfill.components.gallery.upgrade.backfill import embed_streamed


def _fetcher(images, broken, log):
    def fetch(rows):
        log.append(("read", int(rows[0])))
        failures = [ImageFailure(i, f"uri-{r}", "undecodable") for i, r in enumerate(rows) if r in broken]
        out = images[rows].copy()
        out[[f.row for f in failures]] = 0
        return out, failures
    return fetch


def test_streamed_features_and_failures_equal_reading_everything_first():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (23, 1, 4, 4), dtype=np.uint8)
    weights = rng.normal(size=(16, 5)).astype(np.float32)
    embed = lambda batch: batch.reshape(len(batch), -1).astype(np.float32) @ weights  # noqa: E731
    broken = {3, 10, 11, 22}
    features, failures = embed_streamed(_fetcher(images, broken, []), embed, 23, 5, batch=5)
    assert [f.row for f in failures] == sorted(broken) and [f.uri for f in failures] == [f"uri-{r}" for r in sorted(broken)]
    ok = np.array([r not in broken for r in range(23)])
    np.testing.assert_allclose(features[ok], embed(images[ok]), rtol=1e-6)
    assert not features[~ok].any()


def test_the_next_batch_is_read_while_the_model_embeds_this_one():
    images = np.zeros((12, 1, 2, 2), np.uint8)
    log, embedding = [], threading.Event()
    fetch = _fetcher(images, set(), log)
    seen_during_embed = []

    def embed(batch):
        embedding.set()
        # the read of the next batch has started (or finished) before this embed returns
        for _ in range(200):
            if len(log) > len(seen_during_embed) + 1 or len(log) == 3:
                break
            threading.Event().wait(0.005)
        seen_during_embed.append(len(log))
        return np.zeros((len(batch), 2), np.float32)

    embed_streamed(fetch, embed, 12, 2, batch=4)
    assert [entry[1] for entry in log] == [0, 4, 8]
    assert seen_during_embed[:2] == [2, 3]  # batch 1 was read during batch 0's embedding, batch 2 during batch 1's
