"""`search --merge`: the shadow index's answer mid-upgrade, and candidate reranking's, against a
literal reference."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.search.dual import DualSearch
from fastfill.components.gallery.upgrade import backfill, ending
from tests.gallery_cases import NEW, OLD, N, _gallery, _plan, make_data, make_models


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
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
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


def _reranked(old_all, new_all, on_new, ids, old_q, new_q, depth, k):
    """Candidate reranking written out: each query's old top ``depth`` among every item's old
    features; those with new features by their new distance (stable: old order at a tie), the
    others after them in old order, then the old list's tail. Per query, the first k as
    (id, from the new model, distance)."""
    answers = []
    for q in range(len(old_q)):
        d_old = ((old_all.astype(np.float64) - old_q[q]) ** 2).sum(axis=1)
        ranked = [int(i) for i in np.argsort(d_old, kind="stable")]
        candidates, tail = ranked[:depth], ranked[depth:]
        d_new = {c: float(((new_all[c].astype(np.float64) - new_q[q]) ** 2).sum()) for c in candidates if on_new[c]}
        scored = sorted((c for c in candidates if on_new[c]), key=lambda c: d_new[c])
        answer = [(ids[c], True, d_new[c]) for c in scored]
        answer += [(ids[c], False, d_old[c]) for c in candidates + tail if c not in d_new]
        answers.append(answer[:k])
    return answers


def _check_rerank(searcher, gallery, plan, old_q, new_q, depth, k):
    mixed, on_new = backfill.mixed_features(gallery, plan)
    assert (searcher.on_new == on_new).all()
    assert searcher.old_index.ntotal == N  # the old index keeps every item
    got_ids, scores, sources = searcher.search(old_q, new_q, k=k)
    expected = _reranked(gallery.all_features(OLD), mixed, on_new, gallery.ids(), old_q, new_q, depth, k)
    for q, answer in enumerate(expected):
        assert got_ids[q].tolist() == [i for i, _, _ in answer]
        assert sources[q] == [NEW.uri if new else OLD.uri for _, new, _ in answer]
        np.testing.assert_allclose(scores[q], [d for _, _, d in answer], rtol=1e-4, atol=1e-4)
    return got_ids, sources


@pytest.mark.parametrize("depth, k", [(10, 6), (4, 9)])  # k > depth: the old list goes on after the candidates
def test_rerank_is_the_old_top_k_ranked_by_the_new_model(depth, k, tmp_path):
    models, data = make_models(), make_data()
    old, new, h = models
    images = data[0]
    gallery = _gallery(str(tmp_path / "store"), models, data)
    plan = _plan(gallery, h)
    old_q, new_q = embed(old, images[:6]), embed(new, images[:6])
    searcher = DualSearch(gallery, merge="rerank", depth=depth)
    assert searcher.mid_upgrade and searcher.backfilled == 0

    # before any chunk landed: the old model's own ranking
    got_ids, sources = _check_rerank(searcher, gallery, plan, old_q, new_q, depth, k)
    np.testing.assert_array_equal(got_ids, _ranked(gallery.all_features(OLD), gallery.ids(), old_q)[:, :k])
    assert {s for row in sources for s in row} == {OLD.uri}

    # mid-way: the re-embedded candidates first, by new distance
    for chunk in (0, 1, 2):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    assert searcher.refresh() == 3 and searcher.backfilled == 21 and searcher.new_index.ntotal == 21
    _check_rerank(searcher, gallery, plan, old_q, new_q, depth, k)

    # everything landed: every candidate scored, the old index still whole
    for chunk in range(3, plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    assert searcher.refresh() == plan.num_chunks - 3 and searcher.backfilled == N
    _, sources = _check_rerank(searcher, gallery, plan, old_q, new_q, depth, k)
    assert all(row[:depth] == [NEW.uri] * min(depth, k) for row in sources)

    ending.finish(gallery, plan)  # one model again: the gallery's own search
    assert searcher.refresh() == 0 and not searcher.mid_upgrade and searcher.old_model == NEW
    got_ids, _, sources = searcher.search(new_q, None, k=k)
    np.testing.assert_array_equal(got_ids, _ranked(gallery.all_features(NEW), gallery.ids(), new_q)[:, :k])


@pytest.mark.parametrize("distance", ["l2", "cosine"])
def test_rerank_deeper_than_the_gallery_is_the_new_model_once_everything_landed(mid_upgrade, distance):
    gallery, plan, (old, new, _), (images, _) = mid_upgrade
    for chunk in range(3, plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    searcher = DualSearch(gallery, distance, merge="rerank", depth=10 * N)
    old_q, new_q = embed(old, images[:5]), embed(new, images[:5])
    got_ids, scores, sources = searcher.search(old_q, new_q, k=N + 5)
    assert got_ids.shape == (5, N)
    features = backfill.mixed_features(gallery, plan)[0].astype(np.float64)
    if distance == "cosine":  # the new model's own ranking by 1 - cosine
        features /= np.linalg.norm(features, axis=1, keepdims=True)
        unit = new_q / np.linalg.norm(new_q, axis=1, keepdims=True)
        # the tiny model's features are nearly collinear: distances 1e-7 apart, below float32's
        # resolution of 1 - cosine, so the order is checked up to that, and the scores exactly
        reference = (1 - unit @ features.T)[np.arange(5)[:, None], np.searchsorted(gallery.ids(), got_ids)]
        assert (np.diff(reference, axis=1) >= -1e-6).all()
        assert sorted(got_ids[0].tolist()) == gallery.ids().tolist()
        np.testing.assert_allclose(scores, reference, atol=1e-6)
    else:
        expected = np.sort(((new_q[:, None, :] - features[None]) ** 2).sum(-1), axis=1)
        np.testing.assert_array_equal(got_ids, _ranked(features, gallery.ids(), new_q))
        np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    assert {s for row in sources for s in row} == {NEW.uri}


def test_rerank_refuses_a_bad_depth_and_a_missing_new_query(mid_upgrade):
    gallery, _, (old, _, _), (images, _) = mid_upgrade
    for bad in (0, -3, 2.5, True):
        with pytest.raises(GalleryError, match="candidate depth"):
            DualSearch(gallery, merge="rerank", depth=bad)
    with pytest.raises(GalleryError, match="features from both models"):
        DualSearch(gallery, merge="rerank").search(embed(old, images[:2]), None)


def test_rerank_on_the_command_line(mid_upgrade, tmp_path):
    from fastfill.cli import app

    gallery, _, (old, new, _), (images, _) = mid_upgrade
    np.save(tmp_path / "old.npy", embed(old, images[:3]))
    np.save(tmp_path / "new.npy", embed(new, images[:3]))
    store = str(tmp_path / "store")
    queries = ["search", "--store", store, "--features", str(tmp_path / "new.npy"),
               "--old-features", str(tmp_path / "old.npy")]
    runner = CliRunner()
    result = runner.invoke(app, [*queries, "--merge", "rerank", "--depth", "7", "-k", "5"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["merge"] == "rerank" and answer["depth"] == 7 and answer["query_models"] == [OLD.uri, NEW.uri]
    expected, _, sources = DualSearch(gallery, merge="rerank", depth=7).search(
        embed(old, images[:3]), embed(new, images[:3]), k=5)
    assert answer["ids"] == expected.tolist() and answer["sources"] == sources
    default = json.loads(runner.invoke(app, [*queries, "--merge", "rerank", "-k", "5"]).stdout)
    assert default["depth"] == 50  # gallery.upgrade.rerank_depth

    for other in (queries[:5], [*queries, "--merge", "rrf"]):  # no merge, or another merge
        refused = runner.invoke(app, [*other, "--depth", "7"])
        assert refused.exit_code == 2 and "--depth goes with --merge rerank" in refused.output
    for bad in ("0", "-2"):
        refused = runner.invoke(app, [*queries, "--merge", "rerank", "--depth", bad])
        assert refused.exit_code == 2 and f"--depth {bad}:" in refused.output
