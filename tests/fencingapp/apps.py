from __future__ import annotations

from django.apps import AppConfig


class FencingAppConfig(AppConfig):
    name = "tests.fencingapp"
    label = "fencingapp"
    default_auto_field = "django.db.models.BigAutoField"
