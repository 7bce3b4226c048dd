"""Which objects in a team's database are the product's, and of which gallery. Everything the
product creates there (PostgreSQL tables, views and indexes, Milvus collections, the Lance serving
table) carries a mark naming the gallery that made it; the product drops, replaces or deletes from
nothing without its own gallery's mark, and refuses a name something else already holds.

A mark is one line of text::

    fastfill {"gallery": "5f0c2a9e41d7b3c8", "role": "view", "store": "s3://team/gallery"}

(PostgreSQL: the object's ``COMMENT``; Milvus: the collection's description; Lance: the schema
metadata key ``fastfill.gallery``). ``gallery`` is the id the manifest's ``index`` records
(``owner``), minted when the gallery is made; ``store`` says where that gallery lives, so a refusal
can name the owner. A person hands an object over by rewriting its mark (docs/serving.md, "What
the product touches in your database")."""

from __future__ import annotations

import hashlib
import json
import uuid

from fastfill.components.gallery.layouts.catalog import GalleryError

PREFIX = "fastfill "
OWNER_KEY = "owner"        # the manifest index's gallery id
STORE_KEY = "owner_store"  # and the store it names in marks


def new_owner() -> str:
    """A new gallery's id (16 hex digits)."""
    return uuid.uuid4().hex[:16]


def owner_of(settings: dict, store_uri: str = "") -> str:
    """The gallery id of the manifest's ``index`` (``settings``); a gallery made before ids were
    minted is known by its store's URI."""
    return settings.get(OWNER_KEY) or "store-" + hashlib.sha1(str(store_uri).rstrip("/").encode()).hexdigest()[:12]


def mark(owner: str, role: str, store_uri: str = "") -> str:
    """The mark of an object ``role`` (table, vectors, view, serving, chunks, index, collection)
    made by the gallery ``owner`` living in ``store_uri``."""
    return PREFIX + json.dumps({"gallery": owner, "role": role, "store": str(store_uri)}, sort_keys=True)


def read_mark(text: str | None) -> dict | None:
    """The fields of a mark, or None for anything that is not one (no comment, the team's own)."""
    if not text or not text.startswith(PREFIX):
        return None
    try:
        fields = json.loads(text[len(PREFIX):])
    except ValueError:
        return None
    return fields if isinstance(fields, dict) and isinstance(fields.get("gallery"), str) else None


class NotOurs(GalleryError):
    """A name the product would use is held by an object it did not make, or another gallery's."""


def refusal(what: str, found: dict | None, owner: str, setting: str, *, mark_it: str = "",
            from_owner: str = "upgrade, abort, roll back or gc it") -> NotOurs:
    """The one line that refuses to touch ``what``: it is the team's (no mark), or another
    gallery's (its mark names the store); ``setting`` is the one that gives ours another name.
    ``mark_it``: the statement that marks an unmarked object as this gallery's (one an earlier
    release made); ``from_owner``: what the owning store may do with it."""
    if found is None:
        whose = "exists and is not the product's (it has no fastfill mark): it is left as it is"
    else:
        whose = (f"belongs to another gallery ({found.get('gallery')}, store {found.get('store') or 'unknown'}): "
                 f"{from_owner} from that store")
    earlier = f" If it is this gallery's own, made by an earlier release, mark it: {mark_it}." \
        if mark_it and found is None else ""
    return NotOurs(f"{what} {whose}; give this gallery's object another name with {setting} "
                   f"(this gallery is {owner}).{earlier} Nothing was written.")
