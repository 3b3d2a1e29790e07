"""App config: wires up checks and settings receivers; connects to nothing."""

from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class MongoLockConfig(AppConfig):
    name = "django_mongolock"
    label = "django_mongolock"
    verbose_name = _("MongoDB locks")
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        # Importing registers the system checks and the setting_changed receiver.
        from django_mongolock import checks, conf  # noqa: F401
