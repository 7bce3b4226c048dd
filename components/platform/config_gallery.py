"""The gallery's sections of params.yaml (``gallery``, ``promotion``): the stored gallery and its
layouts (parts, Lance, pgvector, Milvus, Qdrant), its S3 client, the faiss index of `fastfill
search`, how `fastfill upgrade` moves the gallery to a new model (``gallery.upgrade``: the map,
the backfill, its evaluation sample) and the gate before `champion` moves (``promotion``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from fastfill.components.platform.config_base import (
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    _without_password,
)
from fastfill.components.platform.vocabulary import RERANK_DEPTH, Distance, GalleryOrder, Precision


class UpgradeConfig(Section):
    """`fastfill upgrade`: how a stored gallery is moved to a new model."""

    method: str = Field(default="fastfill", description="the map method that trains a map when the registry has "
                        "none joining the two versions: a key of align, or of compare.align (lambda_orth: the "
                        "affine lambda-orthogonal map, which has no sigma head, so order random or usage)")
    online: bool = Field(
        default=False, description="also fit online backfilling's metric-compatible reverse transformation (new "
        "queries into the old space, distances comparable with the new space's) on the map's pairs while planning, "
        "and keep it in the store: `fastfill search --merge online` then answers with the new model alone, its "
        "query on the re-embedded items and its reverse transform on the rest, merged by distance")
    rerank_depth: PositiveInt = Field(
        default=RERANK_DEPTH, description="candidate reranking's depth K: the old index's candidates per query that the new "
        "model ranks where they are re-embedded; the default of `fastfill search --merge rerank --depth`, and the "
        "depth of the candidate reranking way `upgrade --dry-run --target-top1` compares")
    order: GalleryOrder = Field(
        default="sigma", description="backfill order: sigma = least certain first (FastFill); random; usage = the "
        "items queries hit most first; usage_sigma = usage weight x predicted error (sigma^2) first, the items "
        "never hit after them in sigma order. The usage orders need weights: usage_log, or a weight column")
    chunk_size: PositiveInt = 1000
    max_concurrency: PositiveInt = Field(default=2, description="chunks in flight at once")
    task_runner: Literal["threads", "dask"] = "threads"
    dask_address: str | None = Field(default=None, description="scheduler of an existing Dask cluster, "
                                     "e.g. tcp://10.0.0.5:8786; null with dask = a temporary local cluster")
    budget: Annotated[float, Field(gt=0, le=1)] | Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="stop the backfill after this fraction (0 < f <= 1.0) or count of items")
    eval_queries: Annotated[int, Field(ge=0)] | Literal["all", "auto"] = Field(
        default="auto", description="labeled items measured along the backfill (queries and their gallery): auto = "
        "as many as eval_standard_error needs, whatever the gallery's size (all of them in a smaller gallery); "
        "all; a count; 0 = off")
    eval_standard_error: Annotated[float, Field(gt=0, le=50)] = Field(
        default=1.5, description="with eval_queries auto: the standard error, in top-1 points, of a point of the "
        "measured and predicted curves at worst (a top-1 of 50%): 0.25 * (100 / it)^2 queries (1.5: 1,112; "
        "1.0: 2,500)")
    stop_when_gain_below: PositiveFloat | None = Field(
        default=None, description="stop the backfill at the budget advisor's recommended fraction: where no later "
        "point of the predicted curve gains this many top-1 points per 5% of the gallery (e.g. 0.1); null: go to "
        "100%. Needs the evaluation sample (eval_queries > 0)")
    batch_size: PositiveInt = Field(default=512, description='images embedded per forward pass')
    precision: Precision = Field(
        default="auto", description="embedding on CUDA: auto = bfloat16 autocast (float16 where bfloat16 is not "
        "supported), fp32 = off; the CPU always computes in float32 under auto")
    max_items_per_second: PositiveFloat | None = Field(
        default=None, description="throttle: start chunks no faster than this many items per second (null: no limit)")
    read_workers: PositiveInt = Field(default=16, description="parallel image reads per chunk (adopted galleries)")
    max_failed_images: Annotated[float, Field(ge=0, lt=1)] | Annotated[int, Field(ge=1)] = Field(
        default=0.01, description="images that may fail to read or decode before the upgrade stops: a fraction "
        "of the items (0 <= f < 1) or a count; the failed items keep their transformed features")
    lease_seconds: Annotated[float, Field(ge=3, le=3600)] = Field(
        default=60, description="the upgrade lock is a lease: its holder renews it every third of this; a lock not "
        "renewed for this long (its holder died or lost the store) is taken over by the next upgrade from any host, "
        "and a holder that could not renew it stops before its next write")
    map_pairs: Literal["gallery", "splits"] = Field(
        default="gallery", description="where the pairs that train and check a map come from when the registry's "
        "map for the two versions has not passed its check on that source: gallery = a seeded sample of the "
        "gallery's own items (old features from the store, new ones by embedding their images; they are written "
        "as backfilled, so no embedding is wasted); splits = the pipeline's prepared new-train split on this host")
    map_sample: Annotated[float, Field(gt=0, le=1)] | Annotated[int, Field(ge=2)] = Field(
        default=5000, description="map_pairs gallery: the items sampled, a count (all of a smaller gallery; it does "
        "not grow with the gallery: what the map and its check need, docs/results.md) or a fraction of the gallery "
        "(0 < f <= 1.0, raised to map_sample_min)")
    map_sample_min: Annotated[int, Field(ge=0)] = Field(
        default=5000, description="map_pairs gallery: a fractional map_sample is at least this many items (all "
        "of a smaller gallery)")
    pseudo_classes: Annotated[int, Field(ge=0)] = Field(
        default=50, description="a new model without a classifier: K-means clusters of the map sample's new features "
        "(at most this many, at least 20 items each) with a linear head fitted on them are the classes the check "
        "counts as matches where the gallery has no labels, and, with pseudo_disc, the map's disc term's classes; "
        "0 = none (no disc term for such a model)")
    pseudo_disc: bool = Field(
        default=False, description="the map's disc term on the pseudo-classes (a new model without a classifier): "
        "off by default, since on the team pairs measured it cost the map top-1 at 0% backfill (docs/results.md, "
        "\"The map on a team's features\"); a new model's own classifier always gets the term")
    recheck: bool = Field(
        default=False, description="check the registry's map again on this upgrade's pairs even when it already "
        "passed its check on the same source")
    judgments: str | None = Field(
        default=None, description="judged queries that the promotion gate and the budget advisor take as their "
        "truth before the gallery's labels: a CSV or Parquet file (local path or s3://) with columns `query` "
        "(a gallery id, or an image URI) and `relevant` (a gallery id), one relevant item per row")
    usage_log: str | None = Field(
        default=None, description="query log that gives the usage orders (usage, usage_sigma) their per-item "
        "weights: a CSV or Parquet file (local path or s3://) with columns `query` (a logged query's id) and `hit` "
        "(a gallery id it returned), one row per hit; an item's weight is the number of distinct queries that hit "
        "it. Null: the items table's weight column (set at adopt)")
    seed: int = Field(default=0, description="the random order's, the evaluation sample's and the map sample's")


class IndexConfig(Section):
    """The faiss index of `fastfill search`: exact (flat), or inverted lists for large galleries."""

    kind: Literal["flat", "ivf", "ivfpq"] = Field(
        default="flat", description="flat: exact, N x d floats in memory; ivf: inverted lists (faster, same "
        "memory); ivfpq: inverted lists of product-quantised codes (pq_m bytes per item)")
    nlist: PositiveInt = Field(default=1024, description="inverted lists (ivf, ivfpq); at most items / 39")
    nprobe: PositiveInt = Field(default=16, description="lists searched per query (ivf, ivfpq)")
    pq_m: PositiveInt = Field(default=16, description="sub-quantisers of ivfpq (must divide the dimension)")
    train_size: PositiveInt = Field(default=50000, description="items sampled to train the lists")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="where searches run: auto = on a CUDA GPU when there is one (faiss's GPU "
        "build from the gpu extra; without it, flat indexes are searched exactly by torch), else the CPU")


class S3Config(Section):
    """How the S3 client of an ``s3://`` gallery meets a busy or failing endpoint: throttling (503
    SlowDown), 5xx errors, dropped connections and slow answers are retried with boto3's
    exponential backoff and jitter; a request failing every attempt stops the command."""

    retry_mode: Literal["standard", "adaptive"] = Field(
        default="standard", description="boto3's retry mode: standard = backoff with jitter; adaptive = that, "
        "plus client-side rate limiting once the endpoint throttles")
    max_attempts: Annotated[int, Field(ge=1, le=50)] = Field(
        default=6, description="attempts per request, the first included (with the standard backoff, 6 attempts "
        "wait about 15 s in all on average, 31 s at most, before the request fails)")
    connect_timeout: PositiveFloat = Field(default=5, description="seconds to open a connection")
    read_timeout: PositiveFloat = Field(
        default=60, description="seconds the endpoint may stay silent during an answer before the attempt fails")


class PgvectorConfig(Section):
    """A gallery served from PostgreSQL with pgvector (gallery.layout pgvector; docs/serving.md):
    the server, the team's table and columns, the view the team's service queries, and the ANN
    index each model's column gets."""

    uri: str = Field(default="", description="postgresql://user@host:port/database (a password is never "
                     "stored: PGPASSWORD or ~/.pgpass); empty = the PG* environment variables; FASTFILL_PG_URI "
                     "replaces it at run time")
    table: str | None = Field(default=None, description="the gallery's table: the team's (`gallery adopt --table` "
                              "sets it); null = a new gallery's own, gallery_<10 hex digits of its store's URI>")
    id_column: str = Field(default="id", description="the table's item id column (integers or text)")
    image_column: str = Field(default="image", description="the column of each item's image URI")
    view: str | None = Field(default=None, description="the view the team's service queries: id, embedding, "
                             "model, source; null = <table>_serving")
    prefix: str | None = Field(default=None, description="the start of the name of every object the product makes "
                               "beside the table (each model's vectors table <prefix>_emb_<model>_v<version>, the "
                               "bookkeeping tables <prefix>_fastfill_serving and _chunks); null = the table's name. "
                               "Another name when one of those is taken by an object that is not this gallery's")
    ann: Literal["hnsw", "ivfflat", "none"] = Field(
        default="ivfflat", description="the ANN index built on each model's vectors before readers move to them: "
        "ivfflat (each chunk's rows enter it cheaply: 1.0 s per 10,000 rows against HNSW's 41 s, "
        "docs/serving.md) or hnsw")
    hnsw_m: PositiveInt = Field(default=16, description="HNSW: links per node")
    hnsw_ef_construction: PositiveInt = Field(default=64, description="HNSW: candidate list while building")
    ef_search: PositiveInt = Field(default=100, description="HNSW: candidate list per search (`fastfill search`; "
                                   "a team's service sets hnsw.ef_search itself)")
    ivfflat_lists: PositiveInt | None = Field(default=None, description="IVFFlat: lists; null = sqrt(rows)")
    ivfflat_probes: PositiveInt = Field(default=10, description="IVFFlat: lists searched per query")
    index_memory: Annotated[str, Field(pattern=r"^[1-9][0-9]*\s*(kB|MB|GB)$")] = Field(
        default="1GB", description="maintenance_work_mem while an ANN index is built (IVFFlat on 1,000,000 "
        "256-d rows needs 221 MB, more than PostgreSQL's 64 MB default)")

    @field_validator("uri", mode="before")
    @classmethod
    def _password_taken(cls, value: object) -> object:
        return _without_password(value)


class MilvusConfig(Section):
    """A gallery served from Milvus (gallery.layout milvus; docs/serving.md): the server, and the
    alias the team's service searches (one collection per model version behind it)."""

    uri: str = Field(default="milvus.db", description="http://host:19530 (a token in MILVUS_TOKEN), or a local "
                     "Milvus Lite file (.db; one process at a time may open it)")
    alias: str | None = Field(default=None, description="the alias the team's service searches; null = a new "
                              "gallery's own, gallery_<10 hex digits of its store's URI>")
    ann: Literal["hnsw", "flat"] = Field(default="hnsw", description="each collection's index")
    hnsw_m: PositiveInt = Field(default=16, description="HNSW: links per node")
    hnsw_ef_construction: PositiveInt = Field(default=64, description="HNSW: candidate list while building")
    ef_search: PositiveInt = Field(default=100, description="HNSW: candidate list per search (`fastfill search`)")

    @field_validator("uri", mode="before")
    @classmethod
    def _password_taken(cls, value: object) -> object:
        return _without_password(value)


class QdrantConfig(Section):
    """A gallery served from Qdrant (gallery.layout qdrant; docs/serving.md): the server, and the
    alias the team's service searches (one collection per model version behind it)."""

    url: str = Field(default="qdrant", description="http(s)://host:6333 (an API key in QDRANT_API_KEY), or a local "
                     "folder for Qdrant's local mode (one process at a time may open it)")
    alias: str | None = Field(default=None, description="the alias the team's service searches; null = a new "
                              "gallery's own, gallery_<10 hex digits of its store's URI>")
    ann: Literal["hnsw", "flat"] = Field(default="hnsw", description="each collection's index (flat: exact search)")
    hnsw_m: PositiveInt = Field(default=16, description="HNSW: links per node")
    hnsw_ef_construction: PositiveInt = Field(default=64, description="HNSW: candidate list while building")
    ef_search: PositiveInt = Field(default=100, description="HNSW: candidate list per search (`fastfill search`)")

    @field_validator("url", mode="before")
    @classmethod
    def _password_taken(cls, value: object) -> object:
        return _without_password(value)


class LanceConfig(Section):
    """A Lance gallery's serving table (gallery.layout lance; docs/serving.md): <store>/serving.lance,
    the table LanceDB readers search, and its ANN index."""

    ann: Literal["ivf_flat", "ivf_hnsw_sq", "none"] = Field(
        default="ivf_flat", description="the serving table's ANN index (none: every search scans)")
    ann_min_rows: NonNegativeInt = Field(default=10000, description="no ANN index under this many rows: a scan "
                                         "is as fast")
    partitions: PositiveInt | None = Field(default=None, description="IVF partitions; null = about the square "
                                           "root of the rows")
    nprobes: PositiveInt = Field(default=20, description="IVF partitions searched per query (`fastfill search`)")


class GalleryConfig(Section):
    """The stored gallery: `fastfill gallery ...`, `fastfill upgrade`, `fastfill search`."""

    store: str = Field(default="gallery", description="a local folder, or s3://bucket/prefix")
    part_size: PositiveInt = 1000
    distance: Distance = "l2"
    layout: Literal["parts", "lance", "pgvector", "milvus", "qdrant"] = Field(
        default="parts", description="the layout of a gallery that ingest or adopt makes: parts (.npy and "
        "Parquet parts with a manifest), lance (the Lance table <store>/gallery.lance that other tools read; "
        "docs/lance.md), pgvector (a PostgreSQL table the team's service queries, gallery.pgvector), milvus "
        "(collections behind an alias, gallery.milvus) or qdrant (collections behind an alias, gallery.qdrant; all "
        "three docs/serving.md); an existing gallery is read in the "
        "layout its manifest names (`fastfill gallery convert` moves it)")
    lance: LanceConfig = LanceConfig()
    pgvector: PgvectorConfig = PgvectorConfig()
    milvus: MilvusConfig = MilvusConfig()
    qdrant: QdrantConfig = QdrantConfig()
    index: IndexConfig = IndexConfig()
    upgrade: UpgradeConfig = UpgradeConfig()
    s3: S3Config = S3Config()


class PromotionConfig(Section):
    """The gate between a finished backfill and moving `champion`: measured on the upgrade's
    evaluation sample, the challenger (new queries, the gallery along its backfill) against the
    champion (the gallery's model on its own features)."""

    gate: bool = Field(default=True, description="false: a complete upgrade switches the gallery and moves "
                       "champion without checking")
    min_top1_auc_gain: Annotated[float, Field(ge=-1, le=1)] = Field(
        default=0.0, description="challenger's mean top-1 along its backfill minus the champion's top-1, at least")
    max_nfr1: Annotated[float, Field(ge=0, le=1)] = Field(
        default=1.0, description="negative flips at top-1 against the champion, mean along the backfill, at most "
        "(1.0: no absolute bound; a weaker champion's right answers flip more under any better model, "
        "docs/upgrade.md)")
    max_relative_nfr1: Annotated[float, Field(ge=0)] = Field(
        default=0.8, description="negative flips at top-1 (mean along the backfill) as a share of those a challenger "
        "of its mean top-1 would make if its errors ignored the champion's right answers, at most: nfr1_mean / "
        "(1 - top1_auc); about 1 for independent errors, 0.47-0.60 measured on real upgrades (docs/upgrade.md)")
    max_fraction_to_gain: Annotated[float, Field(ge=0, le=1)] = Field(
        default=1.0, description="the challenger's top-1 must exceed the champion's by this backfilled fraction")
    curve_points: Annotated[int, Field(ge=0)] = Field(default=20, description="B: the gate's curve has B + 2 points")
