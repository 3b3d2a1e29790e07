"""A report per name, fenced by the lock that writes it."""

from __future__ import annotations

from django.db import models

from django_mongolock.fencing import FenceField


class Report(models.Model):
    """One row per report name: the resource the story tests' holders race to write."""

    name = models.CharField(max_length=100, unique=True)
    body = models.TextField(default="")
    edits = models.IntegerField(default=0)
    updated = models.DateTimeField(auto_now=True)
    fence = FenceField()
    fence_key: str | None  # the column FenceField adds: the key the fence belongs to

    def __str__(self) -> str:
        return self.name
