"""`search --merge`: the shadow index's answer mid-upgrade, against a literal reference."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.search.dual import DualSearch
from fastfill.components.gallery.upgrade import backfill, ending
from tests.gallery_cases import NEW, OLD, N


def _ranked(features, ids, queries):
    distances = ((queries[:, None, :] - features[None]) ** 2).sum(-1)
    return ids[np.argsort(distances, axis=1, kind="stable")]


def _rrf(old_list, new_list, k, limit):
    """Reciprocal rank fusion written out: each item's 1 / (k + rank) in its one list; equal
    scores put the new model's hit first."""
    scored = [(1 / (k + r + 1), 1, int(i)) for r, i in enumerate(new_list)] + \
             [(1 / (k + r + 1), 0, int(i)) for r, i in enumerate(old_list)]
    scored.sort(key=lambda t: (-t[0], -t[1]))
    return [(i, source) for _, source, i in scored[:limit]]


def test_merged_hits_come_from_both_parts_with_their_sources(mid_upgrade):
    gallery, plan, (old, new, _), (images, _) = mid_upgrade
    searcher = DualSearch(gallery, merge="rrf", rrf_k=60)
    assert searcher.mid_upgrade and searcher.backfilled == 21
    assert searcher.old_index.ntotal == N - 21 and searcher.new_index.ntotal == 21
    on_new = searcher.on_new
    ids = gallery.ids()
    old_q, new_q = embed(old, images[:6]), embed(new, images[:6])
    k = 8
    got_ids, _, sources = searcher.search(old_q, new_q, k=k)
    old_ranked = _ranked(gallery.all_features(OLD)[~on_new], ids[~on_new], old_q)
    mixed, backfilled = backfill.mixed_features(gallery, plan)
    assert (backfilled == on_new).all()
    new_ranked = _ranked(mixed[on_new], ids[on_new], new_q)
    for q in range(6):
        expected = _rrf(old_ranked[q][:k], new_ranked[q][:k], 60, k)
        assert got_ids[q].tolist() == [i for i, _ in expected]
        assert sources[q] == [NEW.uri if s else OLD.uri for _, s in expected]
    assert {s for row in sources for s in row} == {OLD.uri, NEW.uri}  # both parts answer

    with pytest.raises(GalleryError, match="features from both models"):
        searcher.search(old_q, None)

    # the rest lands: every item leaves the old index for the new one, by id
    for chunk in range(3, plan.num_chunks):
        backfill.backfill_chunk(gallery.store, plan.id, chunk, new)
    assert searcher.refresh() == plan.num_chunks - 3
    assert searcher.old_index.ntotal == 0 and searcher.new_index.ntotal == N
    got_ids, _, sources = searcher.search(old_q, new_q, k=k)
    all_new = backfill.mixed_features(gallery, plan)[0]
    np.testing.assert_array_equal(got_ids, _ranked(all_new, ids, new_q)[:, :k])
    assert {s for row in sources for s in row} == {NEW.uri}

    ending.finish(gallery, plan)  # one model again: one index, nothing to merge
    assert searcher.refresh() == 0 and not searcher.mid_upgrade and searcher.old_model == NEW


def test_score_merges_rank_each_list_by_its_own_normalised_scores(mid_upgrade):
    gallery, _, (old, new, _), (images, _) = mid_upgrade
    old_q, new_q = embed(old, images[:4]), embed(new, images[:4])
    for merge in ("score_minmax", "score_zscore"):
        got_ids, scores, sources = DualSearch(gallery, merge=merge).search(old_q, new_q, k=10)
        assert got_ids.shape == (4, 10) and len(set(got_ids[0].tolist())) == 10
        assert (np.diff(scores, axis=1) >= -1e-12).all()  # normalised distances, nearest first
        assert {s for row in sources for s in row} <= {OLD.uri, NEW.uri}


def test_search_merge_on_the_command_line(mid_upgrade, tmp_path):
    from fastfill.cli import app

    gallery, _, (old, new, _), (images, _) = mid_upgrade
    np.save(tmp_path / "old.npy", embed(old, images[:3]))
    np.save(tmp_path / "new.npy", embed(new, images[:3]))
    store = str(tmp_path / "store")
    runner = CliRunner()
    result = runner.invoke(app, ["search", "--store", store, "--features", str(tmp_path / "new.npy"),
                                 "--old-features", str(tmp_path / "old.npy"), "--merge", "rrf", "-k", "5"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["merge"] == "rrf" and answer["backfilled"] == 21 and answer["query_models"] == [OLD.uri, NEW.uri]
    assert np.array(answer["ids"]).shape == (3, 5)
    expected, _, sources = DualSearch(gallery).search(embed(old, images[:3]), embed(new, images[:3]), k=5)
    assert answer["ids"] == expected.tolist() and answer["sources"] == sources

    missing = runner.invoke(app, ["search", "--store", store, "--features", str(tmp_path / "new.npy"), "--merge", "rrf"])
    assert missing.exit_code == 2 and "--old-features" in missing.output
    alone = runner.invoke(app, ["search", "--store", store, "--features", str(tmp_path / "new.npy"),
                                "--old-features", str(tmp_path / "old.npy")])
    assert alone.exit_code == 2 and "goes with --merge" in alone.output
