"""System check ids, in one place, and the checks of single setting values.

Every ``mongolock.*`` id the package reports is named here (docs/checks.md says what each
means): the settings' ids are reported by ``conf.settings_problems()`` and
``conf.settings_warnings()``, the server's by ``checks.check_server``. The value checks are
pure: a value in, a message fragment (or None) out, so they run before anything connects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote_plus

from pymongo import uri_parser

from django_mongolock.mongo import redact
from django_mongolock.validation import validate_ttl

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


def _check_optional_text(value: Any) -> str | None:
    """USERNAME, PASSWORD and OWNER: None, or text the driver and the server can carry."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\x00" in value:
        return "must be None or a non-empty str without NUL"
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


def _check_audit_retention(value: Any) -> str | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        return "must be None or a whole number of seconds >= 0"
    return None


def _check_refresh(value: Any) -> str | None:
    return None if type(value) is bool else "must be True or False"


VALUE_CHECKS: Final[Mapping[str, tuple[str, Callable[[Any], str | None]]]] = {
    "URL": (URL_INVALID, _check_url),
    "DATABASE": (NAME_INVALID, _check_name),
    "COLLECTION": (NAME_INVALID, _check_name),
    "TTL": (TTL_INVALID, _check_ttl),
    "RETENTION": (RETENTION_INVALID, _check_retention),
    "REFRESH": (REFRESH_INVALID, _check_refresh),
    "OWNER": (OWNER_INVALID, _check_optional_text),
    "SERVER_SELECTION_TIMEOUT": (SERVER_SELECTION_TIMEOUT_INVALID, _check_ttl),
    "USERNAME": (CREDENTIAL_INVALID, _check_optional_text),
    "PASSWORD": (CREDENTIAL_INVALID, _check_optional_text),
    "AUDIT_RETENTION": (AUDIT_RETENTION_INVALID, _check_audit_retention),
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
