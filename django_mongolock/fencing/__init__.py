"""Fenced writes: the protected resource refuses a write from a holder a newer one replaced.

A lock's fencing token grows with every acquisition of its key. A resource that keeps the
greatest token it accepted next to the data (its *fence*, with the key it belongs to) and
takes a write only when the writer's token is not below it, in one atomic statement,
turns a stale holder's late write into a ``StaleTokenError`` instead of lost data.

- Django ORM: ``FenceField`` on the model, ``fenced_update`` and ``fenced_save``.
- pymongo: ``fenced_update_one``.

See docs/fencing.md for the rule and the exact condition each helper writes.
"""

from __future__ import annotations

from django_mongolock.exceptions import FenceKeyConflict, StaleTokenError
from django_mongolock.fencing.mongo import fenced_update_one
from django_mongolock.fencing.orm import FenceField, fenced_save, fenced_update

__all__ = [
    "FenceField",
    "FenceKeyConflict",
    "StaleTokenError",
    "fenced_save",
    "fenced_update",
    "fenced_update_one",
]
