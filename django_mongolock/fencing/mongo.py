"""Fenced writes to MongoDB documents: ``fenced_update_one``.

The rule, in one ``update_one`` (``fence`` stands for ``field``)::

    filter: {"$and": [<filter>,
                      {"$or": [{"fence": {"$eq": null, "$not": {"$type": "array"}}},
                               {"fence": {"$type": "number", "$not": {"$type": "array"},
                                          "$lte": token},
                                "fence_key": {"$in": [key, null]}}]}]}
    update: <update> plus {"$set": {"fence": token, "fence_key": key}}

MongoDB matches and modifies the document in one atomic step, so no read comes between
the check and the write. The type checks matter: ``null`` and ``$lte`` alone would match an
array holding one null or one small number.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from bson.regex import Regex
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

    A document whose fence is neither missing, null nor a number (an array, a string) is
    never written: ValueError naming it, since only a fenced write should set the fence.

    ``upsert=True`` needs ``filter`` to name one ``_id`` by equality (a value or
    ``{"$eq": value}``, not ``$in``, ``$gte`` or a regex): when a newer holder's document exists
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
            # The type checks keep an array from passing on one element ($eq null, $lte
            # and $type match any element of an array): only a missing/null or number
            # fence writes. ($expr would say it shorter, but an upsert's filter refuses it.)
            {
                "$or": [
                    {field: {"$eq": None, "$not": {"$type": "array"}}},
                    {
                        field: {"$type": "number", "$not": {"$type": "array"}, "$lte": lock.token},
                        key_field: {"$in": [lock.key, None]},
                    },
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
    if upsert and not _is_equality(filter.get("_id", _MISSING)):
        raise ValueError(
            "upsert=True needs filter to name the document's _id by equality (a value or "
            "{'$eq': value}): only a collision on that _id keeps a refused upsert from "
            f"inserting a new document; got filter {filter!r}"
        )


_MISSING = object()


def _is_equality(value: object) -> bool:
    """Whether ``value``, as a filter's ``_id``, names one _id that an upsert inserts."""
    if value is _MISSING or isinstance(value, re.Pattern | Regex):
        return False
    if isinstance(value, Mapping):
        operators = [k for k in value if isinstance(k, str) and k.startswith("$")]
        if not operators:
            return True  # an embedded document _id, compared whole
        return list(value) == ["$eq"] and _is_equality(value["$eq"])
    return True


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
    odd = collection.find_one(
        {
            "$and": [
                dict(filter),
                {"$expr": {"$not": [{"$in": [{"$type": f"${field}"}, _FENCE_TYPES]}]}},
            ]
        },
        projection={field: 1},
    )
    if odd is not None:
        raise ValueError(
            f"document {odd.get('_id')!r} has {field}={odd.get(field)!r}, not a number: a "
            "fenced write refuses it (only fenced writes may set the fence)"
        )
    top = collection.find_one(
        {"$and": [dict(filter), {"$expr": {"$isNumber": f"${field}"}}]},
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


_FENCE_TYPES = ["missing", "null", "int", "long", "double", "decimal"]
"""The $type names of a fence a fenced write can judge: missing/null, or a number."""


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
