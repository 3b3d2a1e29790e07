"""System checks: the ``MONGOLOCK`` setting always; the server only with ``--database``.

Their ids are named in ``problems``, all in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks

from django_mongolock import conf
from django_mongolock.exceptions import MongoLockError
from django_mongolock.problems import (
    INDEX_DIFFERS,
    INDEXES_MISSING,
    SERVER_STANDALONE,
    SERVER_UNUSABLE,
)

__all__ = ["check_server", "check_settings"]

_DOCS = "https://django-mongolock.readthedocs.io/en/latest/"


@checks.register()
def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Invalid or unknown ``MONGOLOCK`` values, reported before anything connects, and a
    password left where Django shows it."""
    messages: list[checks.CheckMessage] = [
        checks.Error(problem.msg, hint=problem.hint, id=f"mongolock.{problem.id}")
        for problem in conf.settings_problems()
    ]
    messages.extend(
        checks.Warning(problem.msg, hint=problem.hint, id=f"mongolock.{problem.id}")
        for problem in conf.settings_warnings()
    )
    return messages


@checks.register(checks.Tags.database)
def check_server(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[checks.CheckMessage]:
    """The server is reachable, is a replica set, and has the indexes.

    Runs only for ``manage.py check --database ...`` (and ``migrate``), so ``runserver``
    never waits on MongoDB.
    """
    if databases is None or conf.settings_problems():
        return []
    manager = conf.get_manager()
    try:
        kind = manager.server_kind()
        if kind == "standalone":
            return [
                checks.Error(
                    f"MongoDB at {', '.join(manager.store.servers())} is a standalone server; "
                    "locks need a replica set (a single-node one is fine).",
                    hint=f"Start mongod with --replSet and run rs.initiate(). {_DOCS}guarantees/",
                    id=f"mongolock.{SERVER_STANDALONE}",
                )
            ]
        plan = manager.check_indexes(kind=kind)
    except MongoLockError as exc:
        return [
            checks.Error(
                f"Cannot use the lock collection: {exc}",
                hint=f"Check MONGOLOCK['URL'] or MONGOLOCK_URL. {_DOCS}configuration/",
                id=f"mongolock.{SERVER_UNUSABLE}",
            )
        ]
    messages: list[checks.CheckMessage] = []
    missing = [item.description for item in plan if item.action == "missing"]
    if missing:
        messages.append(
            checks.Warning(
                f"The lock collection lacks: {', '.join(missing)}.",
                hint="Run 'python manage.py migrate_mongolock'.",
                id=f"mongolock.{INDEXES_MISSING}",
            )
        )
    for item in plan:
        if item.action == "differs":
            messages.append(
                checks.Warning(
                    f"The {item.description} is out of date ({item.detail}).",
                    hint="Run 'python manage.py migrate_mongolock' to update it in place.",
                    id=f"mongolock.{INDEX_DIFFERS}",
                )
            )
    return messages
