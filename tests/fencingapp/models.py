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


class Team(models.Model):
    """The other side of a join: entries are filtered by their team's name."""

    name = models.CharField(max_length=100)

    def __str__(self) -> str:
        return self.name


class Entry(models.Model):
    """A fenced row with a foreign key, so that a queryset can filter across a join."""

    name = models.CharField(max_length=100, unique=True)
    body = models.TextField(default="")
    team = models.ForeignKey(Team, on_delete=models.CASCADE)
    fence = FenceField()
    fence_key: str | None

    def __str__(self) -> str:
        return self.name


class Archive(models.Model):
    """A parent (multi-table inheritance) that holds the fence: its children cannot fence."""

    name = models.CharField(max_length=100, unique=True)
    body = models.TextField(default="")
    fence = FenceField()
    fence_key: str | None

    def __str__(self) -> str:
        return self.name


class ArchiveCopy(Archive):
    """A child whose fence lives on its parent's table."""

    extra = models.TextField(default="")


class Note(models.Model):
    """A parent without a fence: its child fences its own table."""

    title = models.CharField(max_length=100, default="")

    def __str__(self) -> str:
        return self.title


class Memo(Note):
    """A child whose fence and body live on its own table, its title on the parent's."""

    body = models.TextField(default="")
    fence = FenceField()
    fence_key: str | None
