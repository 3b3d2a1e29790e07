"""Settings: the ``MONGOLOCK`` dict, its defaults, and the default LockManager built from it.

Nothing is read at import time. Values are read once and cached; the cache (and the
default manager with its client) is dropped when a test overrides ``MONGOLOCK``.
"""

from __future__ import annotations

import difflib
import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import environ
from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from pymongo import uri_parser

from django_mongolock.exceptions import ConfigurationError
from django_mongolock.manager import DEFAULT_URL, LockManager
from django_mongolock.store import _redact
from django_mongolock.validation import validate_ttl

__all__ = [
    "DEFAULTS",
    "ENV_URL",
    "MongoLockSettings",
    "get_manager",
    "get_settings",
    "reset",
    "settings_problems",
]

ENV_URL: Final = "MONGOLOCK_URL"

DEFAULTS: Final[Mapping[str, Any]] = {
    # None: the MONGOLOCK_URL environment variable, else mongodb://localhost:27017/.
    "URL": None,
    "DATABASE": "mongolock",
    "COLLECTION": "locks",
    # Lease length in seconds; the refresher extends held leases at about a third of it.
    "TTL": 30.0,
    # Seconds an expired lock document stays (shown as expired) before the TTL index purges it.
    "RETENTION": 600,
    # Whether held leases are extended in the background.
    "REFRESH": True,
    # Holder name prefix; None: the host name. The pid and a random part are appended.
    "OWNER": None,
    # Seconds to find a usable server before an operation fails with ServerUnavailable.
    "SERVER_SELECTION_TIMEOUT": 5.0,
}


@dataclass(frozen=True, slots=True)
class MongoLockSettings:
    """The effective settings, with where the URL came from (for error messages)."""

    url: str
    url_source: str
    database: str
    collection: str
    ttl: float
    retention: int
    refresh: bool
    owner: str | None
    server_selection_timeout: float
    raw: Mapping[str, Any]


def _user_settings() -> Any:
    return getattr(django_settings, "MONGOLOCK", {})


@functools.cache
def _env_url() -> str | None:
    value = environ.Env().str(ENV_URL, default=None)
    return value or None


@functools.cache
def get_settings() -> MongoLockSettings:
    """The effective settings; values are not validated here (see ``settings_problems``)."""
    raw = _user_settings()
    user = raw if isinstance(raw, Mapping) else {}
    merged = {**DEFAULTS, **{k: v for k, v in user.items() if k in DEFAULTS}}
    if merged["URL"] is not None:
        url, source = merged["URL"], "MONGOLOCK['URL']"
    elif _env_url() is not None:
        url, source = _env_url(), f"the {ENV_URL} environment variable"
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
    )


@dataclass(frozen=True, slots=True)
class Problem:
    """One invalid setting: a check id suffix, the message, and a hint."""

    id: str
    msg: str
    hint: str


def _check_url(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"must be a str, not {type(value).__name__}"
    if value.startswith("mongodb+srv://"):
        return None  # parsing an SRV URL needs DNS; the driver reports it on first use
    if not value.startswith("mongodb://"):
        return "must be a MongoDB URL starting with mongodb:// or mongodb+srv://"
    try:
        uri_parser.parse_uri(value)
    except Exception as exc:  # the parser raises several types for bad input
        return f"is not a valid MongoDB URL: {_redact(str(exc))}"
    return None


def _check_name(value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return "must be a non-empty str"
    if any(c in value for c in '/\\. "$\x00'):
        return 'must not contain any of / \\ . space " $ or NUL'
    return None


def _check_ttl(value: Any) -> str | None:
    try:
        validate_ttl(value, name="the value")
    except (TypeError, ValueError) as exc:
        return str(exc).removeprefix("the value ")
    return None


def _check_retention(value: Any) -> str | None:
    if type(value) is not int or value < 0:
        return "must be a whole number of seconds >= 0"
    return None


def _check_refresh(value: Any) -> str | None:
    return None if type(value) is bool else "must be True or False"


def _check_owner(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\x00" in value:
        return "must be None or a non-empty str without NUL"
    return None


_VALIDATORS: Final[Mapping[str, tuple[str, Callable[[Any], str | None]]]] = {
    "URL": ("E003", _check_url),
    "DATABASE": ("E004", _check_name),
    "COLLECTION": ("E004", _check_name),
    "TTL": ("E005", _check_ttl),
    "RETENTION": ("E006", _check_retention),
    "REFRESH": ("E007", _check_refresh),
    "OWNER": ("E008", _check_owner),
    "SERVER_SELECTION_TIMEOUT": ("E009", _check_ttl),
}


def settings_problems() -> list[Problem]:
    """Every problem with the ``MONGOLOCK`` setting (empty when all is well)."""
    raw = _user_settings()
    hint = "See https://django-mongolock.readthedocs.io/en/latest/configuration/"
    if not isinstance(raw, Mapping):
        return [Problem("E001", f"MONGOLOCK must be a dict, not {type(raw).__name__}.", hint)]
    problems = []
    for name in sorted(set(raw) - set(DEFAULTS)):
        close = difflib.get_close_matches(str(name), DEFAULTS, n=1)
        maybe = f" Did you mean {close[0]!r}?" if close else ""
        problems.append(
            Problem("E002", f"MONGOLOCK has an unknown key {name!r}.{maybe}", hint + "#settings")
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
    }
    for name, (check_id, validate) in _VALIDATORS.items():
        error = validate(values[name])
        if error is not None:
            where = current.url_source if name == "URL" else f"MONGOLOCK[{name!r}]"
            shown = "(hidden)" if name == "URL" else repr(values[name])
            problems.append(
                Problem(check_id, f"{where} {error}; got {shown}.", f"{hint}#{name.lower()}")
            )
    return problems


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
            _manager = LockManager(
                current.url,
                database=current.database,
                collection=current.collection,
                ttl=current.ttl,
                retention=current.retention,
                refresh=current.refresh,
                owner=current.owner,
                server_selection_timeout=current.server_selection_timeout,
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
