"""A gallery's item ids, as the team has them: integers, or text (SKUs, UUIDs, paths).

A gallery's ids are one kind or the other, fixed when it is ingested or adopted: an int64 array,
or an array of str (numpy's unicode dtype, so sorting and searching work as for integers). A cell
of a team's file (judgments, a query log) is read as an id of the gallery's kind: for integer ids
an integer, an integral float or digits in text; for text ids its text, stripped (an integer cell
is its decimal digits). Positions are found by a sorted search either way, never by a dict of
a billion entries.
"""

from __future__ import annotations

import re

import numpy as np

_INTEGER = re.compile(r"[+-]?\d+")


def is_text(ids: np.ndarray) -> bool:
    """Whether ``ids`` are text ids (else int64)."""
    return np.asarray(ids).dtype.kind in "USO"


def id_array(values) -> np.ndarray:
    """``values`` (a list, an array, a pyarrow array or column) as a gallery's ids: int64 when
    the column is of integers, else str."""
    if hasattr(values, "type"):  # pyarrow
        import pyarrow as pa

        if pa.types.is_integer(values.type):
            return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)
        values = values.to_pylist()
    array = np.asarray(values)
    if array.dtype.kind in "iu":
        return array.astype(np.int64)
    if len(array) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray([str(v) for v in array.tolist()], dtype=str)


def id_of(value, text: bool):
    """One cell as an id of the gallery's kind (``text``), or None when it cannot be one."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return str(int(value)) if text else int(value)
    if isinstance(value, (float, np.floating)):
        if not (np.isfinite(value) and float(value).is_integer()):
            return None if not text else str(value)
        return str(int(value)) if text else int(value)
    cell = str(value).strip()
    if text:
        return cell or None
    return int(cell) if _INTEGER.fullmatch(cell) else None


def positions_of(ids: np.ndarray, values) -> np.ndarray:
    """Gallery positions of the ids ``values`` (``ids``: the gallery's, in position order), -1
    where no item has the id; ``values`` are of the gallery's kind (``id_of``)."""
    ids = np.asarray(ids)
    if is_text(ids):
        ids = ids.astype(str)
        wanted = np.asarray([str(v) for v in values], dtype=str) if len(values) else np.zeros(0, dtype=str)
    else:
        ids, wanted = ids.astype(np.int64), np.asarray(values, dtype=np.int64)
    if not len(ids):
        return np.full(len(wanted), -1, dtype=np.int64)
    sorter = np.argsort(ids, kind="stable")
    slot = np.clip(np.searchsorted(ids, wanted, sorter=sorter), 0, len(ids) - 1)
    found = sorter[slot]
    return np.where(ids[found] == wanted, found, -1).astype(np.int64)


def ids_at(ids: np.ndarray, positions) -> np.ndarray:
    """The ids at ``positions`` (an index's answers, any shape); where it found no item (-1): -1
    for integer ids, None for text ids."""
    positions = np.asarray(positions, dtype=np.int64)
    picked = ids[np.maximum(positions, 0)] if len(ids) else np.zeros(positions.shape, dtype=ids.dtype)
    if is_text(ids):
        found = picked.astype(object)
        found[positions < 0] = None
        return found
    return np.where(positions >= 0, picked, -1).astype(np.int64)


def as_json(value):
    """An id as JSON has it: int or str (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    return str(value)
