"""The store's interface, its errors and what every store shares: checksums, fences, JSON.

``Store`` is bytes under string keys, each object written whole with its SHA-256 and checked on
every read; ``components.gallery.store.local`` and ``components.gallery.store.s3`` implement it
(``components.gallery.store`` describes how each keeps the checksum with the bytes).
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

# numpy parses a .npy header with ast.literal_eval, which CPython 3.11.7 does not run safely from
# several threads at once ("AST constructor recursion depth mismatch", gh-106905): the header is
# read under one lock, the data outside it.
_HEADER_LOCK = threading.Lock()


def load_array(data: bytes) -> np.ndarray:
    """The array a ``.npy`` file's bytes hold (no pickles), safe from many threads."""
    stream = io.BytesIO(data)
    with _HEADER_LOCK:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    if dtype.hasobject:
        raise ValueError("an array of Python objects (pickled) is not read")
    count = int(np.prod(shape, dtype=np.int64))
    array = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    return array.reshape(shape[::-1]).T.copy() if fortran else array.reshape(shape).copy()


class StoreError(RuntimeError):
    """A store operation failed; the message names the object and what to do."""


class ObjectMissing(StoreError):
    pass


class ChecksumMismatch(StoreError):
    pass


class DamagedObject(StoreError):
    """An object read whole, its checksum matching, whose contents disagree with the gallery's
    manifest (a features part with fewer rows than its items): a data error, which no retry fixes."""


class StoreUnreachable(StoreError):
    pass


class Conflict(StoreError):
    """A conditional write found the object other than expected: another writer was first."""


class AlreadyExists(Conflict):
    """A create-only write found the key taken (used for locks)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------------
# Fences: a lock holder's veto on this process's writes to one store


_FENCES: dict[str, tuple[str, Callable[[str], None]]] = {}
_FENCES_LOCK = threading.Lock()


def fence(store: Store, owner: str, check: Callable[[str], None]) -> None:
    """From now on every ``put`` and ``delete`` of ``store``'s objects in this process first calls
    ``check(key)``, which raises to refuse the write. One fence per store: a later one (a newer
    lock of the same gallery) replaces an earlier one. ``swap`` and ``delete_if`` are not fenced:
    they are the lock's own writes, and their condition guards them."""
    with _FENCES_LOCK:
        _FENCES[store.identity] = (owner, check)


def unfence(store: Store, owner: str) -> None:
    """Remove ``owner``'s fence of ``store`` (a fence that another owner replaced stays)."""
    with _FENCES_LOCK:
        if _FENCES.get(store.identity, (None,))[0] == owner:
            del _FENCES[store.identity]


class Store(ABC):
    """Bytes under string keys ("a/b/c.npy"), checksummed."""

    uri: str

    @property
    @abstractmethod
    def identity(self) -> str:
        """The same string for every Store object of one place (fences are keyed by it)."""

    @abstractmethod
    def _put(self, key: str, data: bytes, digest: str, *, create_only: bool) -> None: ...

    @abstractmethod
    def _get_versioned(self, key: str) -> tuple[bytes, str | None, str]:
        """(bytes, the recorded checksum or None, the object's version)."""

    def _get(self, key: str) -> tuple[bytes, str | None]:
        """(bytes, the recorded checksum or None): what ``get`` reads."""
        return self._get_versioned(key)[:2]

    @abstractmethod
    def _swap(self, key: str, data: bytes, digest: str, expected: str | None) -> str: ...

    @abstractmethod
    def _delete_if(self, key: str, expected: str) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a folder-like prefix, "a/b/"), sorted."""

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def check(self) -> None:
        """Raise StoreUnreachable when the store can't be reached or doesn't exist."""

    # ---- bytes with checksums

    def _fenced(self, key: str) -> None:
        entry = _FENCES.get(self.identity)
        if entry is not None:
            entry[1](key)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> str:
        self._fenced(key)
        digest = sha256(data)
        self._put(key, data, digest, create_only=create_only)
        return digest

    def delete(self, key: str) -> None:
        self._fenced(key)
        self._delete(key)

    def get(self, key: str) -> bytes:
        data, recorded = self._get(key)
        self._verify(key, data, recorded)
        return data

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes (checked) and its version, for a later ``swap`` or ``delete_if``."""
        data, recorded, version = self._get_versioned(key)
        self._verify(key, data, recorded)
        return data, version

    def _verify(self, key: str, data: bytes, recorded: str | None) -> None:
        actual = sha256(data)
        if recorded is None:
            raise ChecksumMismatch(f"{self.describe(key)} has no recorded checksum; it was not written by "
                                   "this store. Remove it, or re-run the command that writes it")
        if actual != recorded:
            raise ChecksumMismatch(f"{self.describe(key)} is corrupt: its SHA-256 is {actual[:12]}..., "
                                   f"the recorded one {recorded[:12]}...; re-run the command that writes it")

    def swap(self, key: str, data: bytes, *, expected: str | None) -> str:
        """Write ``data`` to ``key`` only if the object is still version ``expected`` (from
        ``get_versioned`` or an earlier ``swap``), or, with ``expected=None``, only if there is
        none; atomically, so of two writers exactly one wins. Returns the new version; raises
        AlreadyExists (``expected=None``) or Conflict when the object is not as expected."""
        return self._swap(key, data, sha256(data), expected)

    def delete_if(self, key: str, *, expected: str) -> None:
        """Delete ``key`` only if it is still version ``expected`` (Conflict otherwise); an
        object already gone is no error."""
        self._delete_if(key, expected)

    def describe(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"

    # ---- typed helpers

    def put_json(self, key: str, value: object, *, create_only: bool = False) -> str:
        return self.put(key, json_bytes(value), create_only=create_only)

    def get_json(self, key: str) -> dict:
        return parse_json(self, key, self.get(key))

    def put_array(self, key: str, array: np.ndarray) -> str:
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
        return self.put(key, buffer.getvalue())

    def get_array(self, key: str) -> np.ndarray:
        data = self.get(key)
        try:
            return load_array(data)
        except ValueError as error:
            raise StoreError(f"{self.describe(key)} is not a readable array: {error}") from None

    def put_parquet(self, key: str, table) -> str:
        import pyarrow.parquet as pq

        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        return self.put(key, buffer.getvalue())

    def get_parquet(self, key: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = self.get(key)
        try:
            return pq.read_table(io.BytesIO(data))
        except (pa.ArrowInvalid, OSError) as error:
            raise StoreError(f"{self.describe(key)} is not a readable parquet table: {error}") from None


def json_bytes(value: object) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def parse_json(store: Store, key: str, data: bytes) -> dict:
    try:
        return json.loads(data)
    except ValueError as error:
        raise StoreError(f"{store.describe(key)} is not valid JSON: {error}") from None
