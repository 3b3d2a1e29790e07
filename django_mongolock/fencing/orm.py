"""Fenced writes through the Django ORM: ``FenceField``, ``fenced_update``, ``fenced_save``.

The rule, in one SQL statement (``fence`` and ``fence_key`` stand for the field and its
companion key column)::

    UPDATE t SET ..., fence = :token, fence_key = :key
     WHERE (<the queryset's conditions>)
       AND (fence IS NULL
            OR (fence <= :token AND (fence_key = :key OR fence_key IS NULL)))

The database evaluates the condition and writes the row in one step, under the row's
write lock (PostgreSQL re-checks it on the newest row version after a concurrent update,
InnoDB reads the newest version, SQLite has one writer at a time), so no read comes
between the check and the write. The condition must stay on the updated table itself:
Django moves a joined filter into a subquery (which PostgreSQL does not re-check) or a
pre-select (MySQL), so such a queryset's primary keys are read first and the UPDATE
filters on them; an update that would span tables (multi-table inheritance) is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar, cast

from django.db import models, router, transaction
from django.db.models import F, Q, QuerySet, sql
from django.db.models.lookups import Exact

from django_mongolock.exceptions import FenceKeyConflict, StaleTokenError
from django_mongolock.fencing.common import check_lock, shown
from django_mongolock.lock import Lock

__all__ = ["KEY_MAX_LENGTH", "FenceField", "FenceKeyField", "fenced_save", "fenced_update"]

KEY_MAX_LENGTH = 1024
"""The companion key column's length: lock keys are at most 1024 bytes (``validation``)."""

_M = TypeVar("_M", bound=models.Model)


class FenceKeyField(models.CharField):  # type: ignore[type-arg]
    """The companion column of a FenceField: the lock key its fence belongs to.

    Its ``samekey`` lookup compares byte for byte on every backend: MySQL's default
    collations would take "Report" and "report", or "k" and "k ", for one key.
    """


@FenceKeyField.register_lookup
class SameKey(Exact):
    """``fence_key__samekey=key``: equal as bytes (``= BINARY %s`` on MySQL/MariaDB)."""

    lookup_name = "samekey"

    def get_rhs_op(self, connection: Any, rhs: str) -> str:
        if connection.vendor == "mysql":
            return f"= BINARY {rhs}"
        return f"= {rhs}"


class FenceField(models.BigIntegerField):  # type: ignore[type-arg]
    """The greatest fencing token a row accepted: a 64-bit integer, NULL until first fenced.

    On a concrete model it adds a companion column, ``<name>_key``, holding the lock key
    that token belongs to: tokens of different keys are not comparable, so a fenced write
    with a lock of another key is refused (``FenceKeyConflict``) rather than compared.
    Both columns are written only by the fenced helpers (``editable=False``).
    """

    description = "Fencing token (64-bit integer) of the last accepted fenced write"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("null", True)
        kwargs.setdefault("default", None)
        kwargs.setdefault("editable", False)
        if not kwargs["null"]:
            raise ValueError("a FenceField is NULL until the row's first fenced write: null=False")
        super().__init__(*args, **kwargs)

    @property
    def key_name(self) -> str:
        """The companion column's field name: the key the stored fence belongs to."""
        return f"{self.name}_key"

    def contribute_to_class(
        self, cls: type[models.Model], name: str, *args: Any, **kw: Any
    ) -> None:
        super().contribute_to_class(cls, name, *args, **kw)
        # Migrations list the companion field themselves, and their historical models
        # live in the module "__fake__": adding it there too would add it twice.
        if cls._meta.abstract or cls.__module__ == "__fake__":
            return
        companion = FenceKeyField(
            max_length=KEY_MAX_LENGTH, null=True, default=None, editable=False
        )
        cls.add_to_class(self.key_name, companion)


def fence_field(model: type[models.Model]) -> FenceField:
    """The model's one FenceField; a ValueError naming the model when it has none or several."""
    found = [f for f in model._meta.concrete_fields if isinstance(f, FenceField)]
    if len(found) != 1:
        raise ValueError(
            f"{model._meta.label} has {len(found)} FenceField(s); a fenced write needs exactly one"
        )
    return found[0]


def fenced_update(queryset: QuerySet[_M], lock: Lock, **values: Any) -> int:
    """Set ``values`` on the queryset's rows that ``lock`` may write, in one UPDATE.

    A row may be written when its fence is NULL, or is not above ``lock.token`` and
    belongs to ``lock.key``; its fence becomes ``lock.token``. Returns the number of rows
    written. When none was written, one read of the matched rows' greatest fence tells why:
    a greater token of the key raises ``StaleTokenError``, another key ``FenceKeyConflict``,
    and no rows at all returns 0. That read only names the outcome; it never decides a
    write. Rows of a multi-row queryset that a newer holder wrote are skipped, not raised
    for, when others were written: compare the count.

    The lock's own state is not consulted: a lost lock whose key nobody took since still
    writes (no newer token exists to refuse it); the resource refuses only what a newer
    holder supersedes.

    A queryset that filters across a relation (a join) is read first for its primary keys,
    then written by ``UPDATE ... WHERE pk IN (...) AND <fence>``: the fence is checked on
    the row written, never in a subquery's copy. A write that spans tables (a parent's
    field, or a fence on a parent's table, under multi-table inheritance) raises
    ValueError before any query: Django would write the parent in a separate UPDATE.
    """
    if not isinstance(queryset, QuerySet):
        raise TypeError(f"queryset must be a Django QuerySet, got {shown(queryset)}")
    lock = check_lock(lock)
    fence = fence_field(queryset.model)
    for name in values:
        if name in (fence.name, fence.attname, fence.key_name):
            raise ValueError(f"{name!r} is set by the fenced write itself, to the lock's token/key")
    # A fence without a key predates the key column (the hand-written recipe): it is
    # compared by token only, and the write claims it for this key.
    same_key = Q(**{f"{fence.key_name}__samekey": lock.key}) | Q(
        **{f"{fence.key_name}__isnull": True}
    )
    allowed = Q(**{f"{fence.name}__isnull": True}) | (
        Q(**{f"{fence.name}__lte": lock.token}) & same_key
    )
    written_values = {**values, fence.name: lock.token, fence.key_name: lock.key}
    _check_one_table(queryset, written_values)
    target = queryset
    if _joins(queryset):
        # Django would move the filter, fence condition included, into a subquery (or a
        # pre-select on MySQL), and the row written would not be the row checked: pick
        # the rows first, then check the fence on each in the UPDATE itself.
        db = getattr(queryset, "_db", None) or router.db_for_write(queryset.model)
        pks = list(queryset.using(db).values_list("pk", flat=True))
        if not pks:
            return 0
        target = queryset.model._base_manager.using(db).filter(pk__in=pks)
    written = target.filter(allowed).update(**written_values)
    if written:
        return written
    _refused(target, fence, lock)
    return 0


def _check_one_table(queryset: QuerySet[_M], values: dict[str, Any]) -> None:
    """A ValueError naming the model when the UPDATE would write more than one table.

    Django writes a parent model's fields (multi-table inheritance) in a second UPDATE on
    the primary keys it selected first, without the fence condition: the check would come
    before the write instead of in it.
    """
    query = cast(sql.UpdateQuery, queryset.query.chain(sql.UpdateQuery))
    query.add_update_values(values)
    related: dict[type[models.Model], Any] = query.related_updates  # type: ignore[attr-defined]
    if related:
        parents = sorted(m._meta.label for m in related)
        raise ValueError(
            f"a fenced write on {queryset.model._meta.label} would also write the parent "
            f"table(s) of {', '.join(parents)}: the fence and every written field must be "
            "on the model's own table (multi-table inheritance writes parents in a "
            "separate, unfenced UPDATE)"
        )


def _joins(queryset: QuerySet[_M]) -> bool:
    """Whether the queryset's filter reads more than the model's own table."""
    query = queryset.query.chain()
    query.get_initial_alias()
    return query.count_active_tables() > 1


def _refused(queryset: QuerySet[_M], fence: FenceField, lock: Lock) -> None:
    """Raise why the UPDATE wrote nothing, from the matched rows' greatest fence, if any."""
    # The alias the UPDATE went to: the queryset's own, else the router's for writes.
    db = getattr(queryset, "_db", None) or router.db_for_write(queryset.model)
    top = (
        queryset.using(db)
        .filter(**{f"{fence.name}__isnull": False})
        .order_by(F(fence.name).desc())
        .values_list(fence.attname, fence.key_name)
        .first()
    )
    if top is None:
        return
    stored, stored_key = int(top[0]), top[1]
    if stored_key is not None and stored_key != lock.key:
        raise FenceKeyConflict(lock.key, lock.token, str(stored_key), stored)
    if stored > lock.token:
        raise StaleTokenError(lock.key, lock.owner, lock.token, stored)


def fenced_save(
    instance: models.Model,
    lock: Lock,
    update_fields: Iterable[str] | None = None,
    *,
    using: str | None = None,
) -> None:
    """Save ``instance`` under ``lock``'s fence: an INSERT for a new one, else a fenced UPDATE.

    A new instance is inserted whole, its fence set to ``lock.token`` (a unique constraint
    decides a race of two creators: the second gets ``IntegrityError``, and can retry with
    ``fenced_update`` on the row that won). An existing one is written by ``fenced_update``
    on its primary key (``update_fields``, or every concrete field): ``StaleTokenError``
    when a newer holder wrote, the model's ``DoesNotExist`` when the row is gone. Like
    ``QuerySet.update()``, the UPDATE sends no ``pre_save``/``post_save`` signals.
    ``using`` picks the database as ``save(using=...)`` does.
    """
    if not isinstance(instance, models.Model):
        raise TypeError(f"instance must be a Django model instance, got {shown(instance)}")
    lock = check_lock(lock)
    if update_fields is not None and (
        isinstance(update_fields, str) or not isinstance(update_fields, Iterable)
    ):
        raise TypeError(f"update_fields must be field names or None, got {shown(update_fields)}")
    model = type(instance)
    fence = fence_field(model)
    if using is not None and not isinstance(using, str):
        raise TypeError(f"using must be a database alias or None, got {shown(using)}")
    using = using or router.db_for_write(model, instance=instance)
    if instance._state.adding:
        if update_fields is not None:
            raise ValueError("a new instance is inserted whole: update_fields must be None")
        _insert(instance, fence, lock, using)
        return
    fields = _fields(model, fence, update_fields)
    values = {f.attname: f.pre_save(instance, False) for f in fields}
    queryset = model._base_manager.using(using).filter(pk=instance.pk)
    if not fenced_update(queryset, lock, **values):
        gone = f"{model._meta.label} with pk {instance.pk!r} no longer exists"
        raise model.DoesNotExist(gone)  # type: ignore[attr-defined]
    setattr(instance, fence.attname, lock.token)
    setattr(instance, fence.key_name, lock.key)


def _insert(instance: models.Model, fence: FenceField, lock: Lock, using: str) -> None:
    before = getattr(instance, fence.attname), getattr(instance, fence.key_name)
    setattr(instance, fence.attname, lock.token)
    setattr(instance, fence.key_name, lock.key)
    try:
        with transaction.atomic(using=using):
            instance.save(force_insert=True, using=using)
    except BaseException:
        setattr(instance, fence.attname, before[0])
        setattr(instance, fence.key_name, before[1])
        raise


def _fields(
    model: type[models.Model], fence: FenceField, update_fields: Iterable[str] | None
) -> list[models.Field[Any, Any]]:
    """The fields a fenced save writes, checked before any query (ValueError names a bad one)."""
    own = {fence.name, fence.key_name}
    writable = [
        f
        for f in model._meta.concrete_fields
        if not f.primary_key and f.name not in own and not getattr(f, "generated", False)
    ]
    if update_fields is None:
        return writable
    by_name = {f.name: f for f in writable} | {f.attname: f for f in writable}
    chosen: list[models.Field[Any, Any]] = []
    for name in update_fields:
        if not isinstance(name, str) or name not in by_name:
            raise ValueError(
                f"update_fields: {name!r} is not a writable field of {model._meta.label} "
                "(the fence and its key are written by the fenced save itself)"
            )
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    if not chosen:
        raise ValueError("update_fields is empty: nothing to write")
    return chosen
