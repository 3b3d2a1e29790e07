"""System check ids, in one place, and the checks of single setting values.

Every ``mongolock.*`` id the package reports is named here (docs/checks.md says what each
means): the settings' ids are reported by ``conf.settings_problems()`` and
``conf.settings_warnings()``, the server's by ``checks.check_server``. The value checks are
pure: a value in, a message fragment (or None) out, so they run before anything connects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote_plus

from pymongo import uri_parser

from django_mongolock.mongo import redact
from django_mongolock.validation import (
    validate_flag,
    validate_name,
    validate_owner,
    validate_retention,
    validate_ttl,
)

__all__ = [
    "AUDIT_RETENTION_INVALID",
    "CREDENTIALS_CONFLICT",
    "CREDENTIAL_INVALID",
    "INDEXES_MISSING",
    "INDEX_DIFFERS",
    "NAME_INVALID",
    "NOT_A_DICT",
    "OWNER_INVALID",
    "PASSWORD_SHOWN",
    "REFRESH_INVALID",
    "RETENTION_INVALID",
    "SERVER_SELECTION_TIMEOUT_INVALID",
    "SERVER_STANDALONE",
    "SERVER_UNUSABLE",
    "SHARED_STREAM_INVALID",
    "STATS_INVALID",
    "TTL_INVALID",
    "UNKNOWN_KEY",
    "URL_INVALID",
    "VALUE_CHECKS",
    "Problem",
    "url_credentials",
]

# -- the settings (always checked) ----------------------------------------------------------
NOT_A_DICT: Final = "E001"
UNKNOWN_KEY: Final = "E002"
URL_INVALID: Final = "E003"
NAME_INVALID: Final = "E004"  # DATABASE or COLLECTION
TTL_INVALID: Final = "E005"
RETENTION_INVALID: Final = "E006"
REFRESH_INVALID: Final = "E007"
OWNER_INVALID: Final = "E008"
SERVER_SELECTION_TIMEOUT_INVALID: Final = "E009"
CREDENTIAL_INVALID: Final = "E012"  # USERNAME or PASSWORD
CREDENTIALS_CONFLICT: Final = "E013"  # given twice, or a password without a user
AUDIT_RETENTION_INVALID: Final = "E014"
STATS_INVALID: Final = "E015"
SHARED_STREAM_INVALID: Final = "E016"
PASSWORD_SHOWN: Final = "W003"  # a password in a URL that Django shows
# -- the server (checked with ``check --database``) -----------------------------------------
SERVER_UNUSABLE: Final = "E010"
SERVER_STANDALONE: Final = "E011"
INDEXES_MISSING: Final = "W001"
INDEX_DIFFERS: Final = "W002"


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
        return f"is not a valid MongoDB URL: {redact(str(exc))}"
    return None


def _refused(validate: Callable[[Any], object], message: str) -> Callable[[Any], str | None]:
    """A check of a setting's value by the validator the manager applies to the same value
    (one rule, worded for the settings): ``message`` when it refuses the value."""

    def check(value: Any) -> str | None:
        try:
            validate(value)
        except (TypeError, ValueError):
            return message
        return None

    return check


def _check_ttl(value: Any) -> str | None:
    try:
        validate_ttl(value, name="the value")
    except (TypeError, ValueError) as exc:
        return str(exc).removeprefix("the value ")
    return None


def _optional(validate: Callable[[Any], object]) -> Callable[[Any], object]:
    return lambda value: None if value is None else validate(value)


_check_optional_text = _refused(validate_owner, "must be None or a non-empty str without NUL")
_check_name = _refused(
    functools.partial(validate_name, "the value"),
    'must be a non-empty str without any of / \\ . space " $ or NUL',
)
_check_retention = _refused(validate_retention, "must be a whole number of seconds >= 0")
_check_audit_retention = _refused(
    _optional(validate_retention), "must be None or a whole number of seconds >= 0"
)
_check_flag = _refused(functools.partial(validate_flag, "the value"), "must be True or False")


VALUE_CHECKS: Final[Mapping[str, tuple[str, Callable[[Any], str | None]]]] = {
    "URL": (URL_INVALID, _check_url),
    "DATABASE": (NAME_INVALID, _check_name),
    "COLLECTION": (NAME_INVALID, _check_name),
    "TTL": (TTL_INVALID, _check_ttl),
    "RETENTION": (RETENTION_INVALID, _check_retention),
    "REFRESH": (REFRESH_INVALID, _check_flag),
    "OWNER": (OWNER_INVALID, _check_optional_text),
    "SERVER_SELECTION_TIMEOUT": (SERVER_SELECTION_TIMEOUT_INVALID, _check_ttl),
    "USERNAME": (CREDENTIAL_INVALID, _check_optional_text),
    "PASSWORD": (CREDENTIAL_INVALID, _check_optional_text),
    "AUDIT_RETENTION": (AUDIT_RETENTION_INVALID, _check_audit_retention),
    "STATS": (STATS_INVALID, _check_flag),
    "SHARED_STREAM": (SHARED_STREAM_INVALID, _check_flag),
}
"""Each setting's check id and value check."""


def url_credentials(url: str) -> tuple[bool, bool]:
    """Whether ``url`` names a user, and whether it holds a (non-empty) password.

    Read as the driver reads it: the user information ends at the last ``@`` before
    the first ``/``. Works for ``mongodb+srv://`` URLs too, without DNS.
    """
    _, sep, rest = url.partition("://")
    if not sep:
        return False, False
    userinfo, at, _ = rest.partition("/")[0].rpartition("@")
    if not at:
        return False, False
    _, _, password = userinfo.partition(":")
    return True, bool(unquote_plus(password))
