"""The items an upgrade embeds while it plans, chosen and read once for the plan and the dry
run: the map sample (the pairs the map trains and is checked on), the evaluation sample (the
queries the curve, the advisor and the gate measure), the judged queries; and where the map's
pairs come from. Embedding is the caller's (``embed``: images -> new-model features), so the
flow can run it as a task on its GPU worker and the dry run in-process."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fastfill.components.experiment.map_check import is_reference
from fastfill.components.experiment.map_validation import MIN_TRAINING_PAIRS, MIN_VALIDATION_PAIRS
from fastfill.components.gallery.inputs.images import read_images, readable
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, fetch_images
from fastfill.components.gallery.upgrade.lifecycle import SPLITS_SOURCE, choose_map
from fastfill.components.gallery.upgrade.pairs import gallery_source, map_sample_size, sample_positions
from fastfill.components.gallery.upgrade.planning import eval_sample, eval_size
from fastfill.components.platform.registry import ModelRef, find_alignment

Embed = Callable[..., np.ndarray]  # (images, label=None) -> features


def pairs_source(config, store_uri: str) -> str:
    """What the map's pairs are read from (``gallery.upgrade.map_pairs``), as its check records it."""
    return SPLITS_SOURCE if config.map_pairs == "splits" else gallery_source(store_uri)


def pairs_description(config, num_items: int) -> str:
    if config.map_pairs == "splits":
        return "this host's new-train split"
    size = map_sample_size(config.map_sample, config.map_sample_min, num_items)
    return (f"a sample of {size:,} gallery items ({100 * size / max(num_items, 1):.1f}% of the gallery, "
            "embedded while planning), kept as backfilled")


def map_sample(config, num_items: int) -> np.ndarray:
    """The positions of the map sample (seeded)."""
    return sample_positions(num_items, map_sample_size(config.map_sample, config.map_sample_min, num_items), config.seed)


def least_map_sample(validation_fraction: float) -> int:
    """The fewest pairs the map can train on and be checked with: ``validation_fraction`` of
    them held out must reach the check's minimum, and at least two must be left to train on."""

    if validation_fraction == 0:
        return MIN_TRAINING_PAIRS
    size = MIN_TRAINING_PAIRS
    while int(round(validation_fraction * size)) < MIN_VALIDATION_PAIRS or \
            size - int(round(validation_fraction * size)) < MIN_TRAINING_PAIRS:
        size += 1
    return size


def check_map_sample(config, validation_fraction: float, num_items: int, *, checked: bool = True) -> None:
    """Refuse, before anything is embedded, a map sample too small for the check of the map of
    ``config.method`` (gallery.upgrade): the message names ``gallery.upgrade.map_sample`` (the
    setting the user chose), not the check's."""

    size = map_sample_size(config.map_sample, config.map_sample_min, num_items)
    least = least_map_sample(validation_fraction) if checked else MIN_TRAINING_PAIRS
    if size < least:
        whole = " (the whole gallery)" if size == num_items else ""
        method = config.method
        raise GalleryError(
            f"gallery.upgrade.map_sample gives {size} items{whole}, and the {method} map needs at least {least}: "
            f"align.{method}.validation_fraction {validation_fraction} of them are held out to check it, and the "
            f"check needs {MIN_VALIDATION_PAIRS}. Raise gallery.upgrade.map_sample to {least} or more; nothing was "
            "embedded")


def registry_map(client, alignment_model: str, old: ModelRef, new: ModelRef, order: str, source: str):
    """The registry's map version for this pair of versions that an upgrade uses
    (``lifecycle.choose_map``), or None."""
    return choose_map(find_alignment(client, alignment_model, old.version, new.version), order, source)


FAILURES_NAMED = 3  # the unreadable images an error names


def none_readable(what: str, failures: list, root: str | None) -> GalleryError:
    """The error of a sample (``what``) none of whose images could be read: how many were tried,
    the first few and why, and what to check."""
    named = "; ".join(f"{failure.uri}: {failure.reason[:160]}" for failure in failures[:FAILURES_NAMED])
    more = f"; and {len(failures) - FAILURES_NAMED} more" if len(failures) > FAILURES_NAMED else ""
    where = (f"the gallery's image root {root} (`fastfill gallery adopt --root`) holds the relative URIs" if root else
             "the URIs are whole (the gallery was adopted without --root, so a relative URI is read from the "
             "working folder)")
    return GalleryError(f"{what}: none of its {len(failures)} images could be read ({named}{more}); check that {where}, "
                        "that the items' URIs name their images, and for s3:// images the store's endpoint and "
                        "credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID); then run the upgrade again")


def readable_images(gallery: Gallery, positions: np.ndarray, workers: int, what: str,
                    log: Callable[[str], None], preprocessing=None, *,
                    refuse_none: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """(the positions whose image could be read, their images, decoded by ``preprocessing``:
    the model's that embeds them); the others are left out and said so (``what``: the sample's
    name). None of them readable is a GalleryError (``none_readable``) unless ``refuse_none`` is
    False (other images of the upgrade were read)."""
    if not len(positions):
        return positions, None
    images, failures = fetch_images(gallery, positions, workers=workers, preprocessing=preprocessing)
    if failures and len(failures) == len(positions) and refuse_none:
        raise none_readable(what, failures, gallery.image_root)
    if failures:
        log(f"{what}: {len(failures)} of {len(positions)} images could not be read and are left out "
            f"(first: {failures[0].uri}: {failures[0].reason})")
        keep = readable(len(positions), failures)
        positions, images = positions[keep], images[keep]
    return positions, images


def evaluation_positions(gallery: Gallery, config) -> np.ndarray:
    return eval_sample(gallery.labels(), eval_size(config), config.seed, gallery.num_items)


def evaluation_sample(gallery: Gallery, config, embed: Embed, embedded: dict,
                      log: Callable[[str], None], preprocessing=None) -> tuple[np.ndarray, np.ndarray | None]:
    """(positions, new-model features) of the evaluation sample, or (positions, None) with fewer
    than two readable items; items already in ``embedded`` (position -> features: the map
    sample) are not embedded again. ``preprocessing``: the new model's."""
    positions = evaluation_positions(gallery, config)
    missing = np.array([p for p in positions.tolist() if p not in embedded], dtype=np.int64)
    kept, images = readable_images(gallery, missing, config.read_workers, "evaluation sample", log, preprocessing,
                                   refuse_none=not embedded)  # the map sample's images were read
    unreadable = set(missing.tolist()) - set(kept.tolist())
    positions = np.array([p for p in positions.tolist() if p not in unreadable], dtype=np.int64)
    if len(positions) < 2:
        return positions, None
    fresh = dict(zip(kept.tolist(), embed(images, label="embedding the evaluation sample"))) if len(kept) else {}
    new_of = {**embedded, **fresh}
    return positions, np.stack([new_of[int(p)] for p in positions]).astype(np.float32)


def judged_queries(gallery: Gallery, config, judged, embed: Embed, embed_champion: Embed, embedded: dict, *,
                   preprocessing=None, champion_preprocessing=None) -> tuple:
    """The judged queries (``judged``: ``judgments.load_judgments``'s) with their features on both
    sides of the gate, on the parts layout (``judged_features``); a gallery item's new features
    join ``embedded``, so they are backfilled from the start. Images are decoded by each model's
    own ``preprocessing`` (new) and ``champion_preprocessing``."""
    shape = tuple(gallery.manifest()["image_shape"])
    sides = {"new": preprocessing or shape, "champion": champion_preprocessing or shape}
    return judged_features(
        judged, embed, embed_champion, config.judgments, embedded=embedded,
        item_images=lambda positions: fetch_images(gallery, positions, workers=config.read_workers,
                                                   preprocessing=preprocessing),
        item_features=lambda positions: gallery.features_at(gallery.model, positions),
        uri_images=lambda uris, side: read_images(uris, sides[side], root=gallery.image_root,
                                                  workers=config.read_workers))


def judged_features(judged, embed: Embed, embed_champion: Embed, source: str, *, item_images, item_features,
                    uri_images, embedded: dict | None = None) -> tuple:
    """(judged, new-model query features, champion query features), whatever the layout: a
    gallery item's new features are embedded from its image (``item_images(positions)``, unless
    ``embedded`` has them; they join it) and its champion features are the stored ones
    (``item_features(positions)``); an image query (``uri_images(uris, side)``, side ``new`` or
    ``champion``: each model's preprocessing) is embedded by both models. Unreadable query images
    are refused, naming ``source`` (the judgments file)."""
    embedded = {} if embedded is None else embedded
    items = judged.query_positions[judged.query_positions >= 0]
    missing = np.array([p for p in items.tolist() if p not in embedded], dtype=np.int64)
    if len(missing):
        images, failures = item_images(missing)
        _refuse_unreadable(failures, source)
        embedded.update(zip(missing.tolist(), embed(images)))
    inside, outside = np.flatnonzero(judged.query_positions >= 0), judged.image_queries
    new_rows: dict[int, np.ndarray] = {}
    old_rows: dict[int, np.ndarray] = {}
    if len(inside):
        new_rows.update(zip(inside.tolist(), (embedded[int(p)] for p in judged.query_positions[inside])))
        old_rows.update(zip(inside.tolist(), item_features(judged.query_positions[inside])))
    if len(outside):
        uris = [judged.query_uris[i] for i in outside]
        for side, embed_side, rows in (("new", embed, new_rows), ("champion", embed_champion, old_rows)):
            images, failures = uri_images(uris, side)
            _refuse_unreadable(failures, source)
            rows.update(zip(outside.tolist(), embed_side(images)))
    new = np.stack([new_rows[i] for i in range(len(judged))]).astype(np.float32)
    old = np.stack([old_rows[i] for i in range(len(judged))]).astype(np.float32)
    return judged, new, old


def _refuse_unreadable(failures: list, judgments: str) -> None:
    if failures:
        raise GalleryError(f"{len(failures)} judged query images could not be read (first: {failures[0].uri}: "
                           f"{failures[0].reason}); fix them or leave those queries out of {judgments}")


SMALL_GALLERY_STEPS = 300
# a map sample of at least this share of the gallery leaves too little to backfill for a map to be worth its
# training and check: the upgrade embeds the whole gallery while planning instead
REEMBED_SHARE = 0.75


def fit_to_gallery(params, num_items: int):
    """(params, a line saying why they changed, or None) for a gallery of ``num_items``, where the
    map's pairs are the gallery's own (``map_pairs: gallery``). Two sizes change the upgrade's way:

    - the map sample would hold the whole gallery or nearly (at least ``REEMBED_SHARE`` of it):
      nothing, or next to nothing, is left to backfill, so the upgrade is a re-embed. Every item
      is embedded while planning (the map sample becomes the whole gallery) and no map is chosen
      by a check: a short l2-only map (fct, at most ``SMALL_GALLERY_STEPS`` steps, none held out)
      only places the items whose images cannot be read.
    - the gallery is smaller than the fewest pairs that train and check the configured map
      (``least_map_sample``), and no setting can raise it: the same way, instead of a refusal
      naming a setting it cannot reach.

    The order is random (or by usage alone); every item's new features land before the switch
    anyway. Unchanged where the pairs come from the splits, or there is no fct map to take."""
    config, method_config = params.gallery.upgrade, params.upgrade_map
    if config.map_pairs != "gallery" or "fct" not in params.align or num_items < 2:
        return params, None
    size = map_sample_size(config.map_sample, config.map_sample_min, num_items)
    least = least_map_sample(method_config.validation_fraction)
    small = method_config.check != "off" and not is_reference(method_config) and num_items < least
    if not small and size < REEMBED_SHARE * num_items:
        return params, None
    order = "usage" if config.order.startswith("usage") else "random"
    upgrade = config.model_copy(update={"method": "fct", "order": order, "map_sample": num_items})
    # every pair trains it, none held out (the last epoch is kept); at most SMALL_GALLERY_STEPS steps: the map
    # transforms only what cannot be embedded, and 2,000 one-step epochs (the step floor meant for the
    # uncertainty head) took minutes for 50 pairs
    fct = params.align["fct"]
    align = {**params.align, "fct": fct.model_copy(update={"validation_fraction": 0.0,
                                                          "min_steps": min(fct.min_steps, SMALL_GALLERY_STEPS)})}
    changed = params.model_copy(update={"align": align,
                                        "gallery": params.gallery.model_copy(update={"upgrade": upgrade})})
    if small:
        why = (f"the gallery has {num_items} items, fewer than the {least} that train and check a {config.method} "
               f"map (align.{config.method}.validation_fraction {method_config.validation_fraction} of them held "
               "out for its check)")
    else:
        why = (f"the map sample would hold {size:,} of the gallery's {num_items:,} items "
               f"({100 * size / num_items:.0f}%, gallery.upgrade.map_sample {config.map_sample}), leaving "
               f"{'nothing' if size == num_items else 'next to nothing'} to backfill")
    skipped = "no map is checked" if is_reference(method_config) else f"no {config.method} map is trained or checked"
    return changed, (f"{why}: this upgrade re-embeds every item while planning; {skipped}, and a short l2-only map "
                     f"(at most {SMALL_GALLERY_STEPS} steps, no check) places only the items whose images cannot be "
                     f"read; {order} order")
