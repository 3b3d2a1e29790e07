"""Settings: the ``MONGOLOCK`` dict, its defaults, and the default LockManager built from it.

What is wrong with them is reported under the check ids of ``problems``. Nothing is read
at import time. Values are read once and cached; the cache (and the
default manager with its client) is dropped when a test overrides ``MONGOLOCK``.
"""

from __future__ import annotations

import difflib
import functools
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import environ
from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from django_mongolock import stats
from django_mongolock.connection import DEFAULT_URL
from django_mongolock.exceptions import ConfigurationError
from django_mongolock.manager import LockManager
from django_mongolock.problems import (
    CREDENTIALS_CONFLICT,
    NOT_A_DICT,
    PASSWORD_SHOWN,
    UNKNOWN_KEY,
    VALUE_CHECKS,
    Problem,
    url_credentials,
)

__all__ = [
    "DEFAULTS",
    "ENV_PASSWORD",
    "ENV_URL",
    "ENV_USERNAME",
    "MongoLockSettings",
    "get_manager",
    "get_settings",
    "reset",
    "settings_problems",
    "settings_warnings",
]

ENV_URL: Final = "MONGOLOCK_URL"
ENV_USERNAME: Final = "MONGOLOCK_USERNAME"
ENV_PASSWORD: Final = "MONGOLOCK_PASSWORD"

DEFAULTS: Final[Mapping[str, Any]] = {
    # None: the MONGOLOCK_URL environment variable, else mongodb://localhost:27017/.
    "URL": None,
    # The user and password, given to the driver apart from the URL. Django masks a
    # setting named PASSWORD on its error pages; a password inside URL is shown.
    # None: the MONGOLOCK_USERNAME / MONGOLOCK_PASSWORD environment variables, else none.
    "USERNAME": None,
    "PASSWORD": None,
    "DATABASE": "mongolock",
    "COLLECTION": "locks",
    # Lease length in seconds; the refresher extends held leases at about a third of it.
    "TTL": 30.0,
    # Seconds an expired lock document stays (shown as expired) before the TTL index purges it.
    "RETENTION": 600,
    # Seconds a force release stays in the audit trail; None: as long as RETENTION.
    "AUDIT_RETENTION": None,
    # Whether held leases are extended in the background.
    "REFRESH": True,
    # Holder name prefix; None: the host name. The pid and a random part are appended.
    "OWNER": None,
    # Seconds to find a usable server before an operation fails with ServerUnavailable.
    "SERVER_SELECTION_TIMEOUT": 5.0,
    # Whether this process records the contention statistics that the admin charts.
    "STATS": True,
    # Whether the processes of a user on a host share one change stream (Linux only).
    "SHARED_STREAM": False,
}


@dataclass(frozen=True, slots=True)
class MongoLockSettings:
    """The effective settings, with where the URL came from (for error messages).

    The password, and the raw setting that may hold it, are left out of ``repr``.
    """

    url: str
    url_source: str
    database: str
    collection: str
    ttl: float
    retention: int
    refresh: bool
    owner: str | None
    server_selection_timeout: float
    raw: Mapping[str, Any] = field(repr=False)
    audit_retention: int | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    stats: bool = True
    shared_stream: bool = False


def _user_settings() -> Any:
    return getattr(django_settings, "MONGOLOCK", {})


_FROM_SETTINGS: Final = "MONGOLOCK['URL']"
_FROM_ENV: Final = f"the {ENV_URL} environment variable"


@functools.cache
def _env_url() -> str | None:
    value = environ.Env().str(ENV_URL, default=None)
    return value or None


def _env_credential(name: str) -> str | None:
    # Read as is: django-environ would expand a value that starts with "$".
    return os.environ.get(name) or None


@functools.cache
def get_settings() -> MongoLockSettings:
    """The effective settings; values are not validated here (see ``settings_problems``)."""
    raw = _user_settings()
    user = raw if isinstance(raw, Mapping) else {}
    merged = {**DEFAULTS, **{k: v for k, v in user.items() if k in DEFAULTS}}
    username, password = merged["USERNAME"], merged["PASSWORD"]
    if username is None:
        username = _env_credential(ENV_USERNAME)
    if password is None:
        password = _env_credential(ENV_PASSWORD)
    if merged["URL"] is not None:
        url, source = merged["URL"], _FROM_SETTINGS
    elif _env_url() is not None:
        url, source = _env_url(), _FROM_ENV
    else:
        url, source = DEFAULT_URL, "the default"
    return MongoLockSettings(
        url=url,
        url_source=source,
        database=merged["DATABASE"],
        collection=merged["COLLECTION"],
        ttl=merged["TTL"],
        retention=merged["RETENTION"],
        refresh=merged["REFRESH"],
        owner=merged["OWNER"],
        server_selection_timeout=merged["SERVER_SELECTION_TIMEOUT"],
        raw=user,
        audit_retention=merged["AUDIT_RETENTION"],
        username=username,
        password=password,
        stats=merged["STATS"],
        shared_stream=merged["SHARED_STREAM"],
    )


_ENV_NAMES: Final[Mapping[str, str]] = {"USERNAME": ENV_USERNAME, "PASSWORD": ENV_PASSWORD}


def settings_problems() -> list[Problem]:
    """Every problem with the ``MONGOLOCK`` setting (empty when all is well)."""
    raw = _user_settings()
    hint = "See https://django-mongolock.readthedocs.io/en/latest/configuration/"
    if not isinstance(raw, Mapping):
        return [Problem(NOT_A_DICT, f"MONGOLOCK must be a dict, not {type(raw).__name__}.", hint)]
    problems = []
    for name in sorted(set(raw) - set(DEFAULTS)):
        close = difflib.get_close_matches(str(name), DEFAULTS, n=1)
        maybe = f" Did you mean {close[0]!r}?" if close else ""
        problems.append(
            Problem(
                UNKNOWN_KEY, f"MONGOLOCK has an unknown key {name!r}.{maybe}", hint + "#settings"
            )
        )
    current = get_settings()
    values = {
        "URL": current.url,
        "DATABASE": current.database,
        "COLLECTION": current.collection,
        "TTL": current.ttl,
        "RETENTION": current.retention,
        "REFRESH": current.refresh,
        "OWNER": current.owner,
        "SERVER_SELECTION_TIMEOUT": current.server_selection_timeout,
        "USERNAME": current.username,
        "PASSWORD": current.password,
        "AUDIT_RETENTION": current.audit_retention,
        "STATS": current.stats,
        "SHARED_STREAM": current.shared_stream,
    }
    for name, (check_id, validate) in VALUE_CHECKS.items():
        error = validate(values[name])
        if error is not None:
            where = current.url_source if name == "URL" else f"MONGOLOCK[{name!r}]"
            if name in _ENV_NAMES and raw.get(name) is None:
                where = f"the {_ENV_NAMES[name]} environment variable"
            shown = "(hidden)" if name in ("URL", "PASSWORD") else repr(values[name])
            problems.append(
                Problem(check_id, f"{where} {error}; got {shown}.", f"{hint}#{name.lower()}")
            )
    return problems + _credential_problems(current, hint + "#credentials")


def _credential_problems(current: MongoLockSettings, hint: str) -> list[Problem]:
    """Credentials the driver would ignore or pick between silently."""
    url: object = current.url  # may be anything until the URL check has passed
    if not isinstance(url, str):
        return []
    url_user, url_password = url_credentials(url)
    twice = [
        what
        for what, in_url, given in (
            ("a user", url_user, current.username),
            ("a password", url_password, current.password),
        )
        if in_url and given is not None
    ]
    if twice:
        return [
            Problem(
                CREDENTIALS_CONFLICT,
                f"{current.url_source} holds {' and '.join(twice)}, and USERNAME or PASSWORD "
                "gives them again; give the user and password once, as USERNAME and PASSWORD.",
                hint,
            )
        ]
    if current.password is not None and current.username is None and not url_user:
        return [
            Problem(
                CREDENTIALS_CONFLICT,
                "a PASSWORD is given without a USERNAME; the driver would ignore it.",
                hint,
            )
        ]
    return []


def settings_warnings() -> list[Problem]:
    """A password in plain view: in ``MONGOLOCK['URL']``, which Django's DEBUG error page
    and ``diffsettings`` show unmasked; or, with ``DEBUG`` on, in the ``MONGOLOCK_URL``
    environment variable, which the DEBUG page shows among the request's META under
    ``runserver`` (it copies the environment into every request)."""
    current = get_settings()
    url: object = current.url
    if not isinstance(url, str) or not url_credentials(url)[1]:
        return []
    hint = (
        "Give the user and password as MONGOLOCK['USERNAME'] and MONGOLOCK['PASSWORD'] (or "
        f"the {ENV_USERNAME} and {ENV_PASSWORD} environment variables) and leave them out "
        "of the URL. See https://django-mongolock.readthedocs.io/en/latest/configuration/"
        "#credentials"
    )
    if current.url_source == _FROM_SETTINGS:
        return [
            Problem(
                PASSWORD_SHOWN,
                "MONGOLOCK['URL'] holds a password, which Django shows unmasked: on the "
                "DEBUG error page and in diffsettings.",
                hint,
            )
        ]
    if current.url_source == _FROM_ENV and getattr(django_settings, "DEBUG", False):
        return [
            Problem(
                PASSWORD_SHOWN,
                f"The {ENV_URL} environment variable holds a password, which the DEBUG "
                "error page shows unmasked among the request's META under runserver.",
                hint,
            )
        ]
    return []


class _Secret(str):
    """A password whose ``repr`` is masked, as Django masks it.

    The driver keeps it in its credentials object, whose ``repr`` shows up among the
    local variables that Django's DEBUG error page prints for each frame of a traceback
    (an authentication failure raised inside the driver has such frames).
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "'********************'"


class _SettingsLockManager(LockManager):
    """A LockManager that hands the driver the user and password apart from the URL, so
    they never sit in a string that could be shown."""

    def __init__(
        self, url: str, *, username: str | None, password: str | None, **options: Any
    ) -> None:
        super().__init__(url, **options)
        # A password alone goes with the user named in the URL (checked: mongolock.E013).
        self.__credentials: dict[str, str] = {}
        if username is not None:
            self.__credentials["username"] = username
        if password is not None:
            self.__credentials["password"] = _Secret(password)

    def _client_options(self) -> dict[str, Any]:
        return {**super()._client_options(), **self.__credentials}


_manager: LockManager | None = None
_manager_mutex = threading.Lock()


def get_manager() -> LockManager:
    """The default manager (``django_mongolock.locks``), built from settings on first use."""
    global _manager
    manager = _manager
    if manager is not None:
        return manager
    with _manager_mutex:
        if _manager is None:
            problems = settings_problems()
            if problems:
                raise ConfigurationError(
                    "invalid MONGOLOCK settings: " + " ".join(p.msg for p in problems)
                )
            current = get_settings()
            _manager = _SettingsLockManager(
                current.url,
                username=current.username,
                password=current.password,
                database=current.database,
                collection=current.collection,
                ttl=current.ttl,
                retention=current.retention,
                audit_retention=current.audit_retention,
                refresh=current.refresh,
                owner=current.owner,
                server_selection_timeout=current.server_selection_timeout,
                shared_stream=current.shared_stream,
            )
        return _manager


def reset() -> None:
    """Forget the cached settings and close the default manager's client."""
    global _manager
    with _manager_mutex:
        manager, _manager = _manager, None
        get_settings.cache_clear()
        _env_url.cache_clear()
    if manager is not None:
        manager.close()


@receiver(setting_changed)
def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "MONGOLOCK":
        reset()
        if _stats_applied:  # only where the admin turned the statistics on
            apply_stats_setting()


_stats_applied = False


def apply_stats_setting() -> None:
    """Record this process's contention statistics, or stop, as ``MONGOLOCK['STATS']`` says
    (a value that is not a bool is left to the check, ``mongolock.E015``). The admin
    calls it when it is loaded; from then on a change of the setting applies again."""
    global _stats_applied
    _stats_applied = True
    wanted = get_settings().stats
    if wanted is True and not stats.installed():
        stats.install()
    elif wanted is False and stats.installed():
        stats.uninstall()
