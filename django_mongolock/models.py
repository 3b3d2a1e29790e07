"""The admin's handle on the lock collection: a model without a table.

Lock documents live in MongoDB, not in the ORM. An unmanaged model gives the admin what it
needs from a model (the sidebar entry, ``/admin/django_mongolock/lock/``, content type and
permission rows for groups) without a table or a fake ``_meta``. It is not the lock handle:
that is ``django_mongolock.Lock``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["Lock"]


class Lock(models.Model):
    """A lock document of the MongoDB collection, as far as admin permissions go."""

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [
            ("view_lock", _("Can view locks")),
            ("release_lock", _("Can force-release locks")),
        ]
        verbose_name = _("lock")
        verbose_name_plural = _("locks")

    def __str__(self) -> str:
        return str(_("lock"))
