"""A connection string's credentials never show: not in errors, logs, the admin, or commands.

Three URLs carry a user and a password: one to a port where nothing listens, one to the real
test server with a wrong password, one with the right password of a user created for the
test. Everything the package says about them (exception messages and their chained causes,
log records of every logger at DEBUG, pages, command output) is searched for the password.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import Client
from pymongo import MongoClient
from pytest_django.fixtures import Settings as SettingsWrapper

from django_mongolock import LockManager, MongoLockError
from django_mongolock.testing import free_port
from tests.utils import run_command

ROOT = Path(__file__).resolve().parent.parent
USER = "mongolock-auditor"
PASSWORD = "S3cret-Pa55_word"
WRONG = "Wr0ng-Pa55_word"
CASES = ["unreachable", "wrong password", "right password"]


def with_credentials(url: str, password: str) -> str:
    """``url`` with ``USER:password@`` after its scheme."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{USER}:{quote_plus(password)}@{rest}"


@pytest.fixture(scope="module")
def server_user(mongolock_url: str) -> Iterator[None]:
    """A user on the test server; it does not enforce auth, but checks given credentials."""
    client: MongoClient[dict[str, Any]]
    with MongoClient(mongolock_url) as client:
        client.admin.command("createUser", USER, pwd=PASSWORD, roles=["root"])
        try:
            yield
        finally:
            client.admin.command("dropUser", USER)


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest, mongolock_url: str, server_user: None) -> tuple[str, str]:
    """(url, password) of one case."""
    name: str = request.param
    if name == "unreachable":
        url = f"mongodb://127.0.0.1:{free_port()}/?directConnection=true"
        return with_credentials(url, PASSWORD), PASSWORD
    password = WRONG if name == "wrong password" else PASSWORD
    return with_credentials(mongolock_url, password), password


@pytest.fixture
def configured(
    case: tuple[str, str],
    settings: SettingsWrapper,
    caplog: pytest.LogCaptureFixture,
    mongolock_database: str,
) -> tuple[str, str]:
    """Settings naming the case's URL, and every log record captured: (url, password)."""
    url, password = case
    caplog.set_level(logging.DEBUG)
    settings.MONGOLOCK = {
        "URL": url,
        "DATABASE": mongolock_database,
        "SERVER_SELECTION_TIMEOUT": 0.25,
    }
    return url, password


def secrets_in(text: str, password: str) -> list[str]:
    """The forms of the password (and of the credentials part of the URL) found in ``text``."""
    forms = {password, quote_plus(password), f"{USER}:{quote_plus(password)}@"}
    return sorted(form for form in forms if form in text)


def everything_about(exc: BaseException) -> str:
    """An exception as a traceback would print it, causes and contexts included, and repr."""
    return "".join(traceback.format_exception(exc)) + repr(exc)


def logged(caplog: pytest.LogCaptureFixture) -> str:
    return (
        "\n".join(
            f"{record.name} {record.getMessage()} {record.exc_text or ''}"
            for record in caplog.records
        )
        + caplog.text
    )


def test_the_api_never_shows_the_password(
    case: tuple[str, str], caplog: pytest.LogCaptureFixture, mongolock_database: str
) -> None:
    url, password = case
    caplog.set_level(logging.DEBUG)
    said: list[str] = []
    manager = LockManager(url, database=mongolock_database, server_selection_timeout=0.25)
    calls: list[Callable[[], Any]] = [
        lambda: manager.acquire("k", ttl=5),
        lambda: manager.acquire("k", timeout=0.5),
        lambda: manager.status("k"),
        lambda: manager.list(),
        lambda: manager.force_release("k"),
        lambda: manager.server_kind(),
        lambda: manager.ensure_indexes(),
    ]
    try:
        for call in calls:
            try:
                result = call()
            except MongoLockError as exc:
                said.append(everything_about(exc))
            else:
                said.append(repr(result))
                if hasattr(result, "release"):
                    result.release()
        said.append(repr(manager))
    finally:
        manager.close()
    assert secrets_in("\n".join(said), password) == []
    assert secrets_in(logged(caplog), password) == []
    failing = password == WRONG or "directConnection" in url
    assert any("Error" in text for text in said) == failing


def test_the_admin_never_shows_the_password(
    configured: tuple[str, str], admin_client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    url, password = configured
    pages = [
        admin_client.get("/admin/django_mongolock/lock/"),
        admin_client.get("/admin/django_mongolock/lock/k/change/"),
        admin_client.get("/admin/django_mongolock/lock/k/release/?token=1"),
        admin_client.get("/admin/"),
    ]
    text = "\n".join(page.content.decode() for page in pages)
    assert secrets_in(text, password) == []
    assert secrets_in(logged(caplog), password) == []
    if password == WRONG or "directConnection" in url:
        assert pages[0].status_code == 503
        assert "did not answer" in text or "Authentication failed" in text


def test_commands_never_show_the_password(
    configured: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, password = configured
    said: list[str] = []
    try:
        call_command("check", databases=["default"])
    except SystemCheckError as exc:
        said.append(everything_about(exc))
    for args in (
        ("migrate_mongolock", "--check"),
        ("migrate_mongolock",),
        ("mongolock", "list", "--all"),
        ("mongolock", "status", "k", "--json"),
        ("mongolock", "release", "k"),
    ):
        said.append("\n".join(map(str, run_command(*args, verbosity=3))))
    assert secrets_in("\n".join(said), password) == []
    assert secrets_in(logged(caplog), password) == []


@pytest.mark.django_db
def test_a_real_command_line_never_shows_the_password(
    mongolock_url: str, server_user: None, tmp_path: Path
) -> None:
    """``manage.py check --database default`` and ``migrate_mongolock``, with DEBUG logging
    of every logger to stderr and ``--traceback``, for a wrong password and no server."""
    (tmp_path / "credential_settings.py").write_text(
        "from tests.settings import *  # noqa: F403\n"
        f"MONGOLOCK = {{'DATABASE': 'credentials_{uuid.uuid4().hex[:8]}', "
        "'SERVER_SELECTION_TIMEOUT': 0.25}\n"
        "LOGGING = {'version': 1, 'handlers': {'err': {'class': 'logging.StreamHandler'}}, "
        "'root': {'handlers': ['err'], 'level': 'DEBUG'}}\n"
    )
    unreachable = f"mongodb://127.0.0.1:{free_port()}/?directConnection=true"
    for url, password in (
        (with_credentials(mongolock_url, WRONG), WRONG),
        (with_credentials(unreachable, PASSWORD), PASSWORD),
    ):
        for command in (
            ["check", "--database", "default"],
            ["migrate_mongolock", "--traceback", "-v", "3"],
        ):
            done = subprocess.run(
                [sys.executable, "manage.py", *command, "--settings", "credential_settings"],
                cwd=ROOT,
                env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "MONGOLOCK_URL": url, "PATH": ""},
                capture_output=True,
                text=True,
                timeout=60,
            )
            output = done.stdout + done.stderr
            assert done.returncode != 0, output
            assert "127.0.0.1" in output
            assert secrets_in(output, password) == [], output
