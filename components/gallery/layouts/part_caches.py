"""Caches of a gallery's parts shared by the threads of one process: image parts (a
sigma-ordered backfill chunk touches many parts, and neighbouring chunks the same ones) and item
columns (an adopted gallery's image URIs)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol

import numpy as np

from fastfill.components.gallery.store import Store


class Gallery(Protocol):
    """What the caches read of a gallery (``components.gallery.layouts.catalog.Gallery``, which
    imports this module): its store's name, a part's images and items."""

    store: Store

    def images(self, part: int) -> np.ndarray: ...

    def items_part(self, part: int) -> Any: ...


class ImageCache:
    """Image parts read recently, shared by the threads of one process: a backfill chunk in
    sigma order touches many parts, and neighbouring chunks touch the same ones."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._parts: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, int], threading.Lock] = {}

    def get(self, gallery: Gallery, part: int) -> np.ndarray:
        key = (gallery.store.uri, part)
        with self._lock:
            if key in self._parts:
                self._parts.move_to_end(key)
                return self._parts[key]
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:  # one reader per part; the others wait for it
            with self._lock:
                if key in self._parts:
                    return self._parts[key]
            images = gallery.images(part)
            with self._lock:
                self._parts[key] = images
                self._loading.pop(key, None)
                while sum(a.nbytes for a in self._parts.values()) > self.max_bytes and len(self._parts) > 1:
                    self._parts.popitem(last=False)
            return images


IMAGE_CACHE = ImageCache()


class ColumnCache:
    """Columns of item parts read recently (an adopted gallery's image URIs above all), shared by
    the threads of one process: a sigma-ordered chunk holds items of every part, so without it
    each chunk would read every part's items table again."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._columns: OrderedDict[tuple[str, int, str], Any] = OrderedDict()  # pyarrow arrays
        self._lock = threading.Lock()

    def get(self, gallery: Gallery, part: int, name: str):
        key = (gallery.store.uri, part, name)
        with self._lock:
            if key in self._columns:
                self._columns.move_to_end(key)
                return self._columns[key]
        column = gallery.items_part(part).column(name).combine_chunks()
        with self._lock:
            self._columns[key] = column
            while sum(c.nbytes for c in self._columns.values()) > self.max_bytes and len(self._columns) > 1:
                self._columns.popitem(last=False)
        return column


COLUMN_CACHE = ColumnCache()
