"""The upgrade's planning step, as the flow runs it: ``planning_course.PlanningCourse`` decides
the course (the map, the gallery's features through it part by part, the backfill order, the
samples embedded while planning, the plan written last, and what a refusal removes); this binds
its ports (``PlanningSteps``) to Prefect tasks: every store write and MLflow record a retried
task, the parts' transform ``transform-part`` tasks on the flow's task runner."""

from __future__ import annotations

import time

from prefect.futures import as_completed, wait

from fastfill.components.gallery.layouts.catalog import Gallery
from fastfill.components.gallery.upgrade import backfill, planning, samples, usage
from fastfill.components.gallery.upgrade.decider import Course
from fastfill.components.gallery.upgrade.planning_course import PlanningCourse, PlanningSettings
from fastfill.components.platform.config import Params
from fastfill.components.platform.layout import Layout
from fastfill.components.platform.progress import progress
from fastfill.components.platform.registry import ModelRef
from fastfill.tasks import gallery_store as store_tasks
from fastfill.tasks import upgrade_tracking
from fastfill.tasks._policy import log
from fastfill.tasks.embedding import embed_images, embed_split_pairs, gallery_pairs, load_model
from fastfill.tasks.upgrade_map import choose_upgrade_map, fit_reverse_transformation


def plan_upgrade(params: Params, client, experiment: str, gallery: Gallery, course: Course, new: ModelRef,
                 new_model, judged=None) -> planning.Plan:
    """Plan ``course``'s upgrade to ``new`` (``PlanningCourse.plan``), through the run's registry
    ``client`` (``experiment``: where its MLflow run goes). ``judged``: the judged queries
    (``judgments.load_judgments``, read once by the flow), or None without them."""
    steps = _PlanningSteps(params, client, experiment, gallery)
    return PlanningCourse(PlanningSettings.of(params), steps).plan(course, new, new_model, judged)


class _PlanningSteps:
    """``planning_course.PlanningSteps`` over a real gallery, its writes and records Prefect tasks."""

    def __init__(self, params: Params, client, experiment: str, gallery: Gallery):
        self.params, self.client, self.experiment, self.gallery = params, client, experiment, gallery
        self.config, self.uri, self.num_items = params.gallery.upgrade, gallery.store.uri, gallery.num_items

    def base_plan(self, upgrade_id: str) -> planning.Plan | None:
        return planning.load_plan(self.gallery.store, upgrade_id)

    def check_sources(self, sequential: bool) -> None:
        self.gallery.check_sources(sequential=sequential)

    def usage_weights(self) -> usage.Usage:
        return usage.usage_weights(self.gallery, self.config.usage_log)

    def done_chunks(self, upgrade_id: str) -> int:
        return len(backfill.done_chunks(self.gallery.store, upgrade_id))

    def discard(self, upgrade_id: str) -> int:
        return store_tasks.discard_unplanned(self.uri, upgrade_id)

    def open_run(self, fields: dict) -> str:
        return upgrade_tracking.open_upgrade_run(self.client, self.experiment, fields, self.uri)

    def close_run(self, run_id: str, status: str, reason: str) -> None:
        upgrade_tracking.close_upgrade_run(self.client, run_id, status, reason)

    def tag_run(self, run_id: str, tags: dict) -> None:
        upgrade_tracking.tag_run(self.client, run_id, tags)

    def write_sources(self, upgrade_id: str, base: planning.Plan) -> None:
        store_tasks.write_sources(self.uri, upgrade_id, base)

    def write_reverse(self, upgrade_id: str, reverse) -> None:
        store_tasks.write_reverse(self.uri, upgrade_id, reverse)

    def commit(self, plan: planning.Plan, order, embedded: dict, judged, positions, queries, ranks) -> int:
        return store_tasks.commit_plan(self.uri, plan, order, embedded, judged, positions, queries, ranks)

    def choose_map(self, old: ModelRef, new: ModelRef, new_model, run_id: str, pairs):
        return choose_upgrade_map(self.params, self.client, self.uri, old, new, new_model, run_id, pairs)

    def split_pairs(self, old: ModelRef, new_model):
        return embed_split_pairs(Layout(self.params.paths).splits, load_model(old), new_model)

    def gallery_pairs(self, positions, new_model, base: str | None):
        return gallery_pairs(self.uri, positions, new_model, self.config, base)

    def fit_reverse(self, pairs):
        return fit_reverse_transformation(pairs, self.config.pseudo_classes, self.config.seed)

    def transform(self, upgrade_id: str, alignment_map, sequential: bool) -> None:
        """The gallery's features through the map, a ``transform-part`` task per part, shown as they land."""
        futures = [store_tasks.transform_part.submit(self.uri, upgrade_id, alignment_map, p, sequential)
                   for p in range(self.gallery.num_parts)]
        try:
            with progress("planning: the gallery's features through the map", total=self.num_items,
                          log=log) as bar:
                for future in as_completed(futures):
                    bar.advance(future.result())
        except BaseException:
            wait(futures)  # every part's task has ended before the caller removes what planning wrote
            raise

    def order(self, upgrade_id: str, kind: str, seed: int, weights):
        return planning.make_order(self.gallery, upgrade_id, kind, seed, weights)

    def embed_samples(self, new_model, judged, embedded: dict):
        """The samples embedded while planning: the judged queries (both models' features) and the
        evaluation sample; ``embedded`` (position -> new features) gains the sample's items."""
        config, gallery = self.config, self.gallery

        def embed(images, label=None):
            return embed_images(new_model, images, config.batch_size, config.precision, label=label)

        preprocessing = getattr(new_model, "preprocessing", None)
        champion = load_model(gallery.model) if judged is not None else None
        started, before = time.perf_counter(), len(embedded)  # the samples' reading and embedding, timed
        if judged is not None:
            def embed_champion(images, label=None):
                return embed_images(champion, images, config.batch_size, config.precision)

            judged = samples.judged_queries(gallery, config, judged, embed, embed_champion, embedded,
                                            preprocessing=preprocessing,
                                            champion_preprocessing=getattr(champion, "preprocessing", None))
        positions, queries = samples.evaluation_sample(gallery, config, embed, embedded, log, preprocessing)
        embedded.update(zip(positions.tolist(), queries) if queries is not None else ())
        log(f"judged queries and evaluation sample: {len(embedded) - before} more items read and embedded in "
            f"{time.perf_counter() - started:.1f} s")
        return judged, positions, queries

    def log(self, line: str) -> None:
        log(line)
