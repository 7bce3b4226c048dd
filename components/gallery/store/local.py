"""A local folder as a store (the layout is described in ``components.gallery.store``'s doc)."""

from __future__ import annotations

import errno
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from fastfill.components.gallery.store.base import (
    AlreadyExists,
    Conflict,
    ObjectMissing,
    Store,
    StoreError,
    StoreUnreachable,
    sha256,
)

CHECKSUM_SUFFIX = ".sha256"  # the checksum file of the older local layout


_READS = 50  # a local read that keeps losing its object to rewrites gives up after this many tries


class LocalStore(Store):
    """A folder with the object store's layout: key "a/b.npy" is ROOT/a/b.npy, a relative symlink
    to the hidden file that holds its bytes and names its checksum (see the doc of the package,
    ``components.gallery.store``). Names starting with a dot are the store's own (object files,
    guards) and are not keys."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.uri = str(self.root)
        self._identity = str(self.root.resolve())

    @property
    def identity(self) -> str:
        return self._identity

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if key.startswith("/") or ".." in parts or parts[-1].startswith("."):
            raise StoreError(f"invalid key {key!r}")
        return self.root / key

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreUnreachable(f"{self.root} exists and is not a folder; give a folder or an s3:// URI")

    # ---- layout

    @staticmethod
    def _digest_of(path: Path, target: str) -> str | None:
        """The checksum in the name of an object file of ``path`` (None: not one of ours)."""
        head, _, rest = target.rpartition(".")  # ".NAME.DIGEST", "NONCE"
        stem, _, digest = head.rpartition(".")
        if stem == f".{path.name}" and len(digest) == 64 and "/" not in target and rest:
            return digest
        return None

    def _publish(self, path: Path, data: bytes, digest: str, *, sync: bool = False) -> str:
        """Write a new object file and point the key's link at it; returns its name (the version)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        target = f".{path.name}.{digest}.{uuid.uuid4().hex[:12]}"
        with open(path.parent / target, "xb") as handle:
            handle.write(data)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        previous = _link_target(path)
        link = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.link")
        os.symlink(target, link)
        os.replace(link, path)  # the one step that changes what readers see
        if previous is not None and self._digest_of(path, previous) is not None:
            (path.parent / previous).unlink(missing_ok=True)
        path.with_name(path.name + CHECKSUM_SUFFIX).unlink(missing_ok=True)  # the older layout's
        return target

    @contextmanager
    def _guard(self, path: Path):
        """An exclusive flock on the key's hidden guard file: conditional writes of one key, by
        any process or thread, run one at a time. The guard file is never removed (removing a
        locked file would let a second writer lock a new one)."""
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path.with_name(f".{path.name}.guard"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # closing releases the flock

    def _version(self, path: Path) -> str | None:
        """What names the key's current object (its file's name; the older layout: its checksum
        file's content); None if there is none."""
        target = _link_target(path)
        if target is not None:
            return target
        if not path.is_file():
            return None
        try:
            return "sha256:" + path.with_name(path.name + CHECKSUM_SUFFIX).read_text().strip()
        except FileNotFoundError:
            return "unchecked"

    # ---- operations

    def _put(self, key: str, data: bytes, digest: str, *, create_only: bool) -> None:
        path = self._path(key)
        if create_only:
            self._swap(key, data, digest, None)
        else:
            self._publish(path, data, digest)

    def _swap(self, key: str, data: bytes, digest: str, expected: str | None) -> str:
        path = self._path(key)
        with self._guard(path):
            current = self._version(path)
            if expected is None and current is not None:
                raise AlreadyExists(f"{self.describe(key)} already exists")
            if expected is not None and current != expected:
                raise Conflict(f"{self.describe(key)} " + ("no longer exists" if current is None else
                                                             "changed since it was read"))
            return self._publish(path, data, digest, sync=True)

    def _delete_if(self, key: str, expected: str) -> None:
        path = self._path(key)
        with self._guard(path):
            current = self._version(path)
            if current is None:
                return
            if current != expected:
                raise Conflict(f"{self.describe(key)} changed since it was read")
            self._delete(key)

    def _get_versioned(self, key: str) -> tuple[bytes, str | None, str]:
        path = self._path(key)
        for attempt in range(_READS):
            try:
                target = os.readlink(path)
            except FileNotFoundError:
                raise ObjectMissing(f"{self.describe(key)} does not exist") from None
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise StoreError(f"{self.describe(key)} cannot be read: {error.strerror}") from None
                data, recorded = self._read_older_layout(key, path)
                if recorded is not None and sha256(data) != recorded and attempt < 3:
                    time.sleep(0.02 * (attempt + 1))  # that layout's two files are replaced one by one
                    continue
                return data, recorded, "sha256:" + (recorded or "")
            try:
                data = (path.parent / target).read_bytes()
            except FileNotFoundError:
                continue  # rewritten between the link and the file: read the new one
            except OSError as error:
                raise StoreError(f"{self.describe(key)} cannot be read: {error.strerror}") from None
            return data, self._digest_of(path, target), target
        raise StoreError(f"{self.describe(key)} was replaced {_READS} times while being read; is something "
                         "rewriting it in a loop?")

    def _read_older_layout(self, key: str, path: Path) -> tuple[bytes, str | None]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"{self.describe(key)} does not exist") from None
        except OSError as error:
            raise StoreError(f"{self.describe(key)} cannot be read: {error.strerror}") from None
        try:
            recorded = path.with_name(path.name + CHECKSUM_SUFFIX).read_text().strip()
        except FileNotFoundError:
            recorded = None
        return data, recorded

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        keys = []
        for path in base.rglob("*"):
            if (path.name.startswith(".") or path.name.endswith((CHECKSUM_SUFFIX, ".part"))
                    or any(part.startswith(".") for part in path.relative_to(self.root).parts)):
                continue
            if path.is_file():
                keys.append(path.relative_to(self.root).as_posix())
        return sorted(keys)

    def _delete(self, key: str) -> None:
        path = self._path(key)
        target = _link_target(path)
        path.unlink(missing_ok=True)
        path.with_name(path.name + CHECKSUM_SUFFIX).unlink(missing_ok=True)
        if target is not None and self._digest_of(path, target) is not None:
            (path.parent / target).unlink(missing_ok=True)


def _link_target(path: Path) -> str | None:
    """Where the key's link points, or None (no link: absent, or a file of the older layout)."""
    try:
        return os.readlink(path)
    except (FileNotFoundError, OSError):
        return None
