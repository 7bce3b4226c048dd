"""The upgrade's steps on the Lance table (a mixin of ``LanceGallery``): its columns written at
planning, the chunks appended to the backfill table and folded in, the finish and the abort. The
layout and why it is so: components/gallery/layouts/lance_table.py and docs/lance.md."""

from __future__ import annotations

import json
import uuid

import numpy as np

from components.gallery.layouts.catalog import GalleryError
from components.gallery.layouts.lance_format import (
    FINISHED_KEY, UPGRADE_COLUMNS, UPGRADE_KEY, TableCorrupt, Upgrade, _as_numpy, _backfill_fields, _metadata,
    _one_line, _vector_arrays, _vector_fields,
)
from components.platform.registry import ModelRef

# (table, upgrade, token) -> (the upgrade, its number of items), checked by a chunk's first commit
_COMMITTING: dict[tuple[str, str, str], tuple] = {}


class UpgradeSteps:
    """Needs of its host: ``uri``, ``backfill_uri``, ``options``, ``dataset()``, ``upgrade()``,
    ``model()``, ``serving_tags()``, ``_tag_serving()``, ``features()``, ``_read()``, ``_check()``."""

    # ---- an upgrade's columns

    def begin_upgrade(self, upgrade: str, new: ModelRef, mapped: np.ndarray, rank: np.ndarray,
                      log_sigma2: np.ndarray | None = None, token: str | None = None) -> str:
        """Add the upgrade's columns (h(old), sigma, the backfill rank, empty new features) and its
        empty backfill table, then, last, the upgrade's record in the schema metadata: from that
        commit on, queries use the new model against the mixed gallery (as the parts layout's
        manifest, written last). A planning killed before it left columns that no record names:
        they are dropped and written again. Again after the record (a re-run): nothing changes.
        ``token`` names this plan (default: a new one): chunks committed under another token (a
        worker of an aborted plan of the same id) are never read. Returns the token."""
        import lance
        import pyarrow as pa

        from components.gallery.layouts.catalog import check_features

        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is not None:
            if current.id != upgrade:
                raise GalleryError(f"{self.uri}: upgrade {current.id} holds the table; finish or abort it first")
            return current.token
        n = dataset.count_rows()
        mapped = check_features(mapped, new.dim, "the transformed features h(old)")
        rank = np.asarray(rank, dtype=np.int64)
        if len(mapped) != n or len(rank) != n or not np.array_equal(np.sort(rank), np.arange(n)):
            raise GalleryError(f"begin_upgrade: {len(mapped)} transformed rows and a rank of {len(rank)} for {n} items; "
                               "the rank must be a permutation of 0..N-1")
        new = ModelRef(new.name, new.version, int(mapped.shape[1]))
        leftover = [c for c in UPGRADE_COLUMNS if c in dataset.schema.names]
        if leftover:  # a killed planning's (or finish's, or abort's) columns
            dataset.drop_columns(leftover)
            dataset = self.dataset()
        self._remove_backfill()  # rows of an ended upgrade, or of a killed planning
        positions = np.arange(n, dtype=np.int64)
        fields = [pa.field("position", pa.int64()), *_vector_fields("mapped", mapped.shape[1], new),
                  pa.field("log_sigma2", pa.float32()), pa.field("rank", pa.int64())]
        sigma = pa.array(np.asarray(log_sigma2, dtype=np.float32)) if log_sigma2 is not None else \
            pa.nulls(n, pa.float32())
        columns = pa.Table.from_arrays([pa.array(positions), *_vector_arrays(positions, mapped), sigma,
                                        pa.array(rank)], schema=pa.schema(fields))
        dataset.merge(columns, left_on="position")
        self.dataset().add_columns([*_vector_fields("new", mapped.shape[1], new), pa.field("new_chunk", pa.int32())])
        # created empty here, under the upgrade's lock: chunks only ever append (two "create"
        # commits racing on S3 let the second overwrite the first's rows, measured)
        empty = pa.schema(_backfill_fields(mapped.shape[1], new)).empty_table()
        lance.write_dataset(empty, self.backfill_uri, mode="create", storage_options=self.options)
        token = token or uuid.uuid4().hex
        dataset = self.dataset()
        metadata = _metadata(dataset.schema)
        metadata[UPGRADE_KEY] = json.dumps({"id": upgrade, "new": new.to_dict(), "token": token}, sort_keys=True)
        dataset.update_schema_metadata(metadata, replace=True)
        return token

    # ---- the backfill table: chunks appended, folded into the gallery table in batches

    def _backfill_dataset(self):
        import lance

        try:
            return lance.dataset(self.backfill_uri, storage_options=self.options)
        except (ValueError, OSError) as error:
            if "not found" in str(error).lower() or "does not exist" in str(error).lower():
                return None
            raise GalleryError(f"{self.backfill_uri}: cannot open the backfill table: {_one_line(error)}") from None

    def commit_chunk(self, upgrade: str, chunk: int, positions: np.ndarray, features: np.ndarray, token: str) -> dict:
        """The chunk's new features appended to the backfill table in one commit, under a commit id
        of its own. Appends never conflict, so several processes commit at once; a chunk
        committed twice (re-run after a kill, or after a lost reply to its commit) is read once:
        readers keep one commit per chunk, the smallest commit id."""
        import lance
        import pyarrow as pa

        current, n = self._committing(upgrade, token, chunk)
        positions = np.asarray(positions, dtype=np.int64)
        features = np.ascontiguousarray(features, dtype=np.float32)
        if len(positions) != len(features) or len(np.unique(positions)) != len(positions) or \
                (len(positions) and (positions.min() < 0 or positions.max() >= n)):
            raise GalleryError(f"chunk {chunk}: {len(features)} rows need as many distinct positions in 0..{n - 1}")
        dim = current.new.dim
        if features.shape[1:] != (dim,):
            raise GalleryError(f"chunk {chunk}: features of dimension {features.shape[1:]}, the new model's is {dim}")
        commit = uuid.uuid4().hex
        rows = pa.Table.from_arrays([pa.array(positions), pa.array(np.full(len(positions), chunk, dtype=np.int32)),
                                     pa.array([token] * len(positions), pa.string()),
                                     pa.array([commit] * len(positions), pa.string()),
                                     *_vector_arrays(positions, features)],
                                    schema=pa.schema(_backfill_fields(dim, current.new)))
        try:
            lance.write_dataset(rows, self.backfill_uri, mode="append", storage_options=self.options)
        except (OSError, ValueError) as error:
            raise GalleryError(f"{self.backfill_uri}: chunk {chunk} not committed: {_one_line(error)}") from None
        return {"chunk": chunk, "rows": len(positions), "commit": commit}

    def _committing(self, upgrade: str, token: str, chunk: int) -> tuple[Upgrade, int]:
        """(the upgrade, the number of items) that chunks of ``token`` commit to: read and checked
        once per process and plan (the table and its backfill table are opened once, not per
        chunk). A plan aborted after that is still safe: readers keep only the rows of the
        table's own token, and a new plan starts from an empty backfill table."""
        key = (self.uri, upgrade, token)
        if key not in _COMMITTING:
            dataset = self.dataset()
            current = self.upgrade(dataset)
            if current is None or current.id != upgrade or current.token != token:
                held = f"{current.id} {current.token}" if current else "none"
                raise GalleryError(f"{self.uri}: the table's upgrade is {held}, not {upgrade} {token}; chunk {chunk} is "
                                   "not written (a worker of an aborted plan)")
            if self._backfill_dataset() is None:
                raise GalleryError(f"{self.backfill_uri}: the upgrade's backfill table is missing; plan the upgrade "
                                   "again (`fastfill upgrade`)")
            dim = dataset.schema.field("new").type.list_size
            _COMMITTING[key] = (Upgrade(current.id, ModelRef(current.new.name, current.new.version, dim), current.token),
                                dataset.count_rows())
        return _COMMITTING[key]

    def _landed(self, upgrade: Upgrade, exclude: set[int] = frozenset()) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(positions, new features, chunks) committed under the upgrade's token, one commit per
        chunk (the smallest id), digests checked; chunks in ``exclude`` left out."""
        side = self._backfill_dataset()
        dim = upgrade.new.dim or 0
        empty = (np.empty(0, dtype=np.int64), np.empty((0, dim), dtype=np.float32), [])
        if side is None:
            return empty
        token = upgrade.token.replace("'", "")
        marks = self._read(side, ["chunk", "commit"], filter=f"token = '{token}'")
        if marks.num_rows == 0:
            return empty
        chosen = {}
        for chunk, commit in zip(marks.column("chunk").to_pylist(), marks.column("commit").to_pylist(), strict=True):
            if chunk not in exclude and (chunk not in chosen or commit < chosen[chunk]):
                chosen[chunk] = commit
        if not chosen:
            return empty
        wanted = ", ".join(f"'{c}'" for c in sorted(set(chosen.values())))
        data = self._read(side, ["position", "chunk", "new", "new_digest"],
                          filter=f"token = '{token}' AND commit IN ({wanted})", with_address=True)
        dim = side.schema.field("new").type.list_size
        vectors = _as_numpy(data.column("new"), dim)
        self._check(side, data, "new", vectors)
        # an append whose commit was retried after a lost reply can be in the table twice, with
        # the same commit id and the same rows: each position once
        positions, first = np.unique(data.column("position").to_numpy(), return_index=True)
        return positions, vectors[first], sorted(chosen)

    def _folded(self, dataset) -> set[int]:
        if "new_chunk" not in dataset.schema.names:
            return set()
        column = self._read(dataset, ["new_chunk"], filter="new_chunk IS NOT NULL").column("new_chunk")
        return set(np.unique(column.to_numpy()).tolist())

    def fold(self, upgrade: str) -> int:
        """The committed chunks not yet in the gallery table written into its ``new`` column, in
        one commit (an update by position: a re-run writes the same). Then a team's own service
        reading the table sees them. Returns the chunks folded."""
        import pyarrow as pa

        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is None or current.id != upgrade:
            raise GalleryError(f"{self.uri}: upgrade {upgrade} is not the table's")
        if "new" not in dataset.schema.names:
            return 0
        positions, vectors, chunks = self._landed(current, exclude=self._folded(dataset))
        if not chunks:
            return 0
        chunk_of = self._read(self._backfill_dataset(), ["position", "chunk"],
                              filter=f"token = '{current.token}' AND chunk IN ({', '.join(map(str, chunks))})")
        by_position = dict(zip(chunk_of.column("position").to_pylist(), chunk_of.column("chunk").to_pylist(), strict=False))
        dim = dataset.schema.field("new").type.list_size
        fields = [pa.field("position", pa.int64()), *_vector_fields("new", dim, current.new),
                  pa.field("new_chunk", pa.int32())]
        source = pa.Table.from_arrays([pa.array(positions), *_vector_arrays(positions, vectors),
                                       pa.array([by_position[int(p)] for p in positions], pa.int32())],
                                      schema=pa.schema(fields))
        result = dataset.merge_insert("position").when_matched_update_all().execute(source)
        if result["num_inserted_rows"]:
            raise TableCorrupt(f"{self.uri}: folding inserted {result['num_inserted_rows']} rows; positions outside "
                               "the gallery")
        return len(chunks)

    def _remove_backfill(self) -> None:
        """Delete the backfill table's files (after a finish or an abort)."""
        if self.backfill_uri.startswith("s3://"):
            from components.gallery.store import s3_client, s3_endpoint

            bucket, _, prefix = self.backfill_uri[len("s3://"):].partition("/")
            client = s3_client(s3_endpoint())
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        else:
            import shutil

            shutil.rmtree(self.backfill_uri, ignore_errors=True)

    def finish(self, upgrade: str) -> str:
        """Every chunk landed: the chunks folded in, the new features become ``features`` and the
        upgrade's columns go, in steps that each leave a readable table (a re-run after a kill
        completes the rest), then a ``serving-<n>`` tag; the backfill table is deleted last.
        Returns the tag."""
        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is None:
            if self.model(dataset).same_version(self._finished_model(dataset, upgrade)):
                self._remove_backfill()
                return self.serving_tags(dataset)[-1][1]
            raise GalleryError(f"{self.uri}: no upgrade in the table to finish")
        if current.id != upgrade:
            raise GalleryError(f"{self.uri}: the table's upgrade is {current.id}, not {upgrade}")
        if "new" in dataset.schema.names:
            self.fold(upgrade)
            dataset = self.dataset()
            missing = dataset.count_rows(filter="new IS NULL")
            if missing:
                raise GalleryError(f"upgrade {upgrade} is not complete: {missing} items have no new features")
            if "features" in dataset.schema.names:  # the old features go (the version tagged before keeps them)
                dataset.drop_columns(["features", "features_digest"])
                dataset = self.dataset()
            dataset.alter_columns({"path": "new", "name": "features"}, {"path": "new_digest", "name": "features_digest"})
            dataset = self.dataset()
        self._drop_upgrade(dataset, {FINISHED_KEY: json.dumps({"id": upgrade, "model": current.new.to_dict()},
                                                              sort_keys=True)})
        tag = self._tag_serving(self.dataset())
        self._remove_backfill()
        return tag

    def _drop_upgrade(self, dataset, record: dict[str, str] | None = None) -> None:
        """The upgrade's columns that are left dropped, then its metadata replaced by ``record``."""
        leftover = [c for c in UPGRADE_COLUMNS if c in dataset.schema.names]
        if leftover:
            dataset.drop_columns(leftover)
            dataset = self.dataset()
        metadata = _metadata(dataset.schema)
        metadata.pop(UPGRADE_KEY, None)
        dataset.update_schema_metadata({**metadata, **(record or {})}, replace=True)

    def finished_upgrade(self, dataset=None) -> str | None:
        """The id of the upgrade whose finish made the table's current features, if any."""
        raw = _metadata((dataset or self.dataset()).schema).get(FINISHED_KEY)
        return json.loads(raw)["id"] if raw else None

    def _finished_model(self, dataset, upgrade: str) -> ModelRef:
        raw = _metadata(dataset.schema).get(FINISHED_KEY)
        if raw and json.loads(raw)["id"] == upgrade:
            return ModelRef.from_dict(json.loads(raw)["model"])
        return ModelRef("", "")

    def abort(self, upgrade: str) -> None:
        """The upgrade's record goes first (from that commit on, queries use the serving model's
        features again), then its columns and its backfill table. Again after a kill, or with no
        upgrade in the table: the leftovers go."""
        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is not None:
            if current.id != upgrade:
                raise GalleryError(f"{self.uri}: the table's upgrade is {current.id}, not {upgrade}")
            metadata = _metadata(dataset.schema)
            metadata.pop(UPGRADE_KEY, None)
            dataset.update_schema_metadata(metadata, replace=True)
            dataset = self.dataset()
        leftover = [c for c in UPGRADE_COLUMNS if c in dataset.schema.names]
        if leftover:
            dataset.drop_columns(leftover)
        self._remove_backfill()
