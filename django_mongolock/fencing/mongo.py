"""Fenced writes to MongoDB documents: ``fenced_update_one``.

The rule, in one ``update_one`` (``fence`` stands for ``field``)::

    filter: {"$and": [<filter>,
                      {"$or": [{"fence": null},
                               {"fence": {"$lte": token},
                                "fence_key": {"$in": [key, null]}}]}]}
    update: <update> plus {"$set": {"fence": token, "fence_key": key}}

MongoDB matches and modifies the document in one atomic step, so no read comes between
the check and the write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError
from pymongo.results import UpdateResult

from django_mongolock.exceptions import FenceKeyConflict, StaleTokenError
from django_mongolock.fencing.common import check_lock
from django_mongolock.lock import Lock

__all__ = ["fenced_update_one"]


def fenced_update_one(
    collection: Collection[Any],
    filter: Mapping[str, Any],
    update: Mapping[str, Any],
    lock: Lock,
    *,
    upsert: bool = False,
    field: str = "fence",
) -> UpdateResult:
    """Apply ``update`` to one document of ``filter`` that ``lock`` may write, atomically.

    A document may be written when ``field`` is missing or null, or is not above
    ``lock.token`` and ``<field>_key`` is ``lock.key``; ``field`` becomes the token and
    ``<field>_key`` the key. When nothing matched, one read of the filter's document with
    the greatest fence tells why: ``StaleTokenError`` for a greater token of the key,
    ``FenceKeyConflict`` for another key; no such document returns the result as is
    (``matched_count == 0``). The read only names the outcome; it never decides a write.

    ``upsert=True`` needs an ``_id`` in ``filter``: when a newer holder's document exists
    the insert that follows the refused match collides on ``_id`` (``DuplicateKeyError``,
    turned into ``StaleTokenError``), so a refused upsert can never add a duplicate. Only
    update documents (``$set``, ``$inc`` ...) are taken, not pipelines or replacements.
    """
    _check(collection, filter, update, upsert, field)
    lock = check_lock(lock)
    key_field = f"{field}_key"
    _check_update(update, field, key_field)
    guarded = {
        "$and": [
            dict(filter),
            # A fence without a key predates the key field (the hand-written recipe):
            # compared by token only, and claimed for this key by the write.
            {
                "$or": [
                    {field: None},
                    {field: {"$lte": lock.token}, key_field: {"$in": [lock.key, None]}},
                ]
            },
        ]
    }
    fenced = {name: dict(spec) for name, spec in update.items()}
    fenced.setdefault("$set", {}).update({field: lock.token, key_field: lock.key})
    try:
        result = collection.update_one(guarded, fenced, upsert=upsert)
    except DuplicateKeyError:
        if not upsert:
            raise
        _refused(collection, filter, lock, field, key_field)
        raise  # the collision was on another unique index, not the fence
    if result.matched_count == 0 and result.upserted_id is None:
        _refused(collection, filter, lock, field, key_field)
    return result


def _check(
    collection: object, filter: object, update: object, upsert: object, field: object
) -> None:
    """TypeError/ValueError naming the bad argument, before anything is sent."""
    if not isinstance(collection, Collection):
        raise TypeError(f"collection must be a pymongo Collection, got {collection!r}")
    if not isinstance(filter, Mapping):
        raise TypeError(f"filter must be a mapping (a query document), got {filter!r}")
    if isinstance(update, list | tuple):
        raise TypeError(
            "fenced_update_one takes an update document ($set, $inc ...), not a pipeline: "
            f"got {update!r}"
        )
    if not isinstance(update, Mapping):
        raise TypeError(f"update must be an update document, got {update!r}")
    if not isinstance(upsert, bool):
        raise TypeError(f"upsert must be a bool, got {upsert!r}")
    if not isinstance(field, str):
        raise TypeError(f"field must be a str, got {field!r}")
    if not field or field.startswith("$") or "." in field:
        raise ValueError(f"field must be a top-level field name, got {field!r}")
    if upsert and "_id" not in filter:
        raise ValueError(
            "upsert=True needs filter to name the document's _id: only a collision on _id "
            f"keeps a refused upsert from inserting a duplicate; got filter {filter!r}"
        )


def _check_update(update: Mapping[str, Any], field: str, key_field: str) -> None:
    if not update:
        raise ValueError("update is empty: nothing to write")
    for operator, spec in update.items():
        if not isinstance(operator, str) or not operator.startswith("$"):
            raise ValueError(
                f"update must use operators ($set ...), not a replacement document: {update!r}"
            )
        if not isinstance(spec, Mapping):
            raise TypeError(f"update[{operator!r}] must be a mapping, got {spec!r}")
        for path in spec:
            top = str(path).split(".", 1)[0]
            if top in (field, key_field):
                raise ValueError(
                    f"update touches {path!r}: the fenced write sets {field!r} and "
                    f"{key_field!r} itself"
                )


def _refused(
    collection: Collection[Any],
    filter: Mapping[str, Any],
    lock: Lock,
    field: str,
    key_field: str,
) -> None:
    """Raise why the update matched nothing, from the filter's greatest fence, if any."""
    top = collection.find_one(
        {"$and": [dict(filter), {field: {"$ne": None}}]},
        projection={"_id": 0, field: 1, key_field: 1},
        sort=[(field, -1)],
    )
    if top is None:
        return
    stored = top[field]
    stored_key = top.get(key_field)
    if stored_key is not None and stored_key != lock.key:
        raise FenceKeyConflict(lock.key, lock.token, str(stored_key), _int(stored))
    if isinstance(stored, int | float) and stored > lock.token:
        raise StaleTokenError(lock.key, lock.owner, lock.token, int(stored))


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
