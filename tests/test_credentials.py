"""A connection string's credentials never show: not in errors, logs, the admin, or commands.

Three URLs carry a user and a password: one to a port where nothing listens, one to the real
test server with a wrong password, one with the right password of a user created for the
test. Everything the package says about them (exception messages and their chained causes,
log records of every logger at DEBUG, pages, command output) is searched for the password.
"""

from __future__ import annotations

import html
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
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import Client, RequestFactory
from django.views.debug import SafeExceptionReporterFilter, technical_500_response
from pymongo import MongoClient
from pytest_django.fixtures import Settings as SettingsWrapper

from django_mongolock import ConfigurationError, LockManager, MongoLockError, conf, locks
from django_mongolock.checks import check_settings
from django_mongolock.testing import free_port
from tests.utils import ROOT, run_command

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


# -- credentials apart from the URL ------------------------------------------------------------


@pytest.fixture
def apart(
    settings: SettingsWrapper,
    mongolock_url: str,
    mongolock_database: str,
    server_user: None,
    caplog: pytest.LogCaptureFixture,
) -> Callable[..., None]:
    """``apart(password, **more)``: settings with the test user and ``password`` given as
    USERNAME and PASSWORD, next to a URL without credentials; every log record captured."""
    caplog.set_level(logging.DEBUG)

    def configure(password: str, **more: Any) -> None:
        settings.MONGOLOCK = {
            "URL": mongolock_url,
            "DATABASE": mongolock_database,
            "USERNAME": USER,
            "PASSWORD": password,
            "SERVER_SELECTION_TIMEOUT": 2,
            **more,
        }

    return configure


def test_username_and_password_settings_authenticate(apart: Callable[..., None]) -> None:
    """The server checks given credentials: a wrong password fails, so they were given."""
    apart(PASSWORD)
    with locks.lock("apart", ttl=5) as lock:
        assert lock.valid
    apart(WRONG)
    with pytest.raises(MongoLockError, match="Authentication failed") as raised:
        locks.acquire("apart", ttl=5)
    assert secrets_in(everything_about(raised.value), WRONG) == []


def test_the_debug_page_of_a_failed_authentication_shows_no_password(
    apart: Callable[..., None], settings: SettingsWrapper
) -> None:
    """The driver keeps the password in local variables of its frames; the page shows frames."""
    apart(WRONG)
    settings.DEBUG = True
    try:
        locks.acquire("apart", ttl=5)
    except MongoLockError:
        response = technical_500_response(RequestFactory().get("/"), *sys.exc_info())
    else:
        pytest.fail("a wrong password was accepted")
    page = html.unescape(response.content.decode())
    assert "Authentication failed" in page
    assert secrets_in(page, WRONG) == []


def test_a_password_apart_from_the_user_named_in_the_url(
    settings: SettingsWrapper, mongolock_url: str, mongolock_database: str, server_user: None
) -> None:
    scheme, rest = mongolock_url.split("://", 1)
    settings.MONGOLOCK = {
        "URL": f"{scheme}://{USER}@{rest}",
        "DATABASE": mongolock_database,
        "PASSWORD": WRONG,
        "SERVER_SELECTION_TIMEOUT": 2,
    }
    assert check_settings() == []
    with pytest.raises(MongoLockError, match="Authentication failed"):
        locks.acquire("user-in-url", ttl=5)
    settings.MONGOLOCK = {**settings.MONGOLOCK, "PASSWORD": PASSWORD}
    with locks.lock("user-in-url", ttl=5) as lock:
        assert lock.valid


def test_credentials_from_the_environment(
    settings: SettingsWrapper,
    mongolock_url: str,
    mongolock_database: str,
    server_user: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MONGOLOCK_USERNAME", USER)
    monkeypatch.setenv("MONGOLOCK_PASSWORD", WRONG)
    settings.MONGOLOCK = {
        "URL": mongolock_url,
        "DATABASE": mongolock_database,
        "SERVER_SELECTION_TIMEOUT": 2,
    }
    with pytest.raises(MongoLockError, match="Authentication failed"):
        locks.acquire("from-env", ttl=5)
    monkeypatch.setenv("MONGOLOCK_PASSWORD", PASSWORD)
    conf.reset()  # the environment is read once, like the settings
    with locks.lock("from-env", ttl=5) as lock:
        assert lock.valid
    assert "PASSWORD" not in str(getattr(settings, "MONGOLOCK", {}))
    assert check_settings() == []


def test_commands_and_the_admin_never_show_a_password_setting(
    apart: Callable[..., None], admin_client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    apart(WRONG)
    said = [everything_about_command(args) for args in COMMANDS]
    said.append(admin_client.get("/admin/django_mongolock/lock/").content.decode())
    said.append(repr(conf.get_settings()) + repr(conf.get_manager()))
    said.append(repr(conf.get_manager().client.options.pool_options._credentials))
    text = "\n".join(said)
    assert "Authentication failed" in text
    assert secrets_in(text, WRONG) == []
    assert secrets_in(logged(caplog), WRONG) == []


COMMANDS = [
    ("migrate_mongolock", "--check"),
    ("mongolock", "list", "--all"),
    ("mongolock", "status", "k", "--json"),
    ("mongolock", "release", "k"),
]


def everything_about_command(args: tuple[str, ...]) -> str:
    return "\n".join(map(str, run_command(*args, verbosity=3)))


# -- what Django's DEBUG error page shows --------------------------------------------------------


def debug_page(settings: SettingsWrapper) -> str:
    """Django's technical 500 page for an error in a request, as DEBUG = True shows it."""
    settings.DEBUG = True
    request = RequestFactory().get("/")
    try:
        raise RuntimeError("a view failed")
    except RuntimeError:
        response = technical_500_response(request, *sys.exc_info())
    return html.unescape(response.content.decode())


def test_the_debug_page_masks_the_password_setting(
    settings: SettingsWrapper, mongolock_url: str
) -> None:
    settings.MONGOLOCK = {"URL": mongolock_url, "USERNAME": USER, "PASSWORD": PASSWORD}
    safe = SafeExceptionReporterFilter().get_safe_settings()["MONGOLOCK"]
    assert safe["PASSWORD"] == SafeExceptionReporterFilter.cleansed_substitute
    assert safe["USERNAME"] == USER
    page = debug_page(settings)
    assert "MONGOLOCK" in page
    assert USER in page
    assert secrets_in(page, PASSWORD) == []


def test_the_debug_page_shows_a_password_in_the_url(
    settings: SettingsWrapper, mongolock_url: str
) -> None:
    """Why W003 exists: Django masks no part of a URL."""
    settings.MONGOLOCK = {"URL": with_credentials(mongolock_url, PASSWORD)}
    assert PASSWORD in debug_page(settings)
    assert [message.id for message in check_settings()] == ["mongolock.W003"]


def test_the_debug_page_masks_the_password_variable_but_not_the_url_variable() -> None:
    """Under runserver the request's META holds the whole environment (wsgiref copies it):
    MONGOLOCK_PASSWORD is masked there, a password inside MONGOLOCK_URL is not."""
    meta = {
        "MONGOLOCK_PASSWORD": PASSWORD,
        "MONGOLOCK_URL": with_credentials("mongodb://db.example/", WRONG),
    }
    request = RequestFactory().get("/")
    request.META.update(meta)
    safe = SafeExceptionReporterFilter().get_safe_request_meta(request)
    assert safe["MONGOLOCK_PASSWORD"] == SafeExceptionReporterFilter.cleansed_substitute
    assert WRONG in safe["MONGOLOCK_URL"]


def test_the_driver_credentials_do_not_show_the_password(apart: Callable[..., None]) -> None:
    """Error reporters print the local variables of each frame, the driver's included."""
    apart(PASSWORD)
    credentials = conf.get_manager().client.options.pool_options._credentials
    assert credentials is not None
    assert credentials.username == USER
    assert PASSWORD not in repr(credentials)
    assert str(credentials.password) == PASSWORD


def test_diffsettings_never_sees_a_password_from_the_environment(
    settings: SettingsWrapper, monkeypatch: pytest.MonkeyPatch, mongolock_url: str
) -> None:
    """diffsettings prints every setting unmasked: the environment keeps it out."""
    monkeypatch.setenv("MONGOLOCK_PASSWORD", PASSWORD)
    settings.MONGOLOCK = {"URL": mongolock_url, "USERNAME": USER}
    out, _, code = run_command("diffsettings")
    assert code == 0
    assert "MONGOLOCK" in out
    assert PASSWORD not in out
    assert conf.get_settings().password == PASSWORD


# -- the system checks -----------------------------------------------------------------------


def test_the_check_warns_of_a_password_in_the_url_setting(settings: SettingsWrapper) -> None:
    settings.MONGOLOCK = {"URL": "mongodb://app:s3cret@db1,db2/?replicaSet=rs"}
    (warning,) = check_settings()
    assert isinstance(warning, checks.Warning)
    assert warning.id == "mongolock.W003"
    assert "s3cret" not in warning.msg
    assert warning.hint is not None
    assert warning.hint.endswith("/configuration/#credentials")
    registered = checks.run_checks()
    assert "mongolock.W003" in [message.id for message in registered]


@pytest.mark.parametrize(
    "url",
    [
        "mongodb://db1,db2/?replicaSet=rs",
        "mongodb://app@db1/?authMechanism=MONGODB-X509",
        "mongodb://app:@db1/",
        "mongodb://db1/?replicaSet=rs&appName=a:b@c",
    ],
)
def test_no_warning_without_a_password_in_the_url(settings: SettingsWrapper, url: str) -> None:
    settings.MONGOLOCK = {"URL": url}
    assert [message.id for message in check_settings()] == []


def test_the_check_warns_of_a_password_in_the_url_variable_only_with_debug(
    settings: SettingsWrapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MONGOLOCK_URL", "mongodb+srv://app:s3cret@cluster.example/")
    settings.MONGOLOCK = {}
    settings.DEBUG = False
    assert check_settings() == []
    settings.DEBUG = True
    (warning,) = check_settings()
    assert warning.id == "mongolock.W003"
    assert "MONGOLOCK_URL" in warning.msg


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"USERNAME": ""}, "mongolock.E012"),
        ({"USERNAME": "app", "PASSWORD": 1234}, "mongolock.E012"),
        ({"PASSWORD": "s3cret"}, "mongolock.E013"),
        ({"URL": "mongodb://app:s3cret@db/", "USERNAME": "other"}, "mongolock.E013"),
        ({"URL": "mongodb://app:s3cret@db/", "PASSWORD": "s3cret"}, "mongolock.E013"),
    ],
)
def test_credentials_the_driver_would_misread_are_errors(
    settings: SettingsWrapper, value: dict[str, Any], expected: str
) -> None:
    settings.MONGOLOCK = value
    errors = [message for message in check_settings() if isinstance(message, checks.Error)]
    assert [message.id for message in errors] == [expected]
    assert all("s3cret" not in message.msg and "1234" not in message.msg for message in errors)
    with pytest.raises(ConfigurationError, match="invalid MONGOLOCK settings"):
        conf.get_manager()
