"""``manage.py mongolock release|list|status`` against the real server."""

from __future__ import annotations

import itertools
import json
import os
import pwd
import socket
import subprocess
import sys
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pytest_django.fixtures import Settings

from django_mongolock import LockLost, LockManager, clock, locks
from django_mongolock.management.commands.mongolock import Command
from django_mongolock.terminal import relative as _relative
from tests.utils import ROOT, run_command, without_slow_server_warnings

pytestmark = pytest.mark.usefixtures("mongolock_settings")


def _insert_expired(key: str, *, owner: str = "gone:1:dead", token: int = 5) -> None:
    """A lock whose holder died an hour ago, as the TTL monitor has not purged it yet."""
    now = datetime.now(UTC)
    locks.store.collection.insert_one(
        {
            "_id": key,
            "key": key,
            "owner": owner,
            "token": token,
            "acquired_at": now - timedelta(hours=1, seconds=30),
            "refreshed_at": now - timedelta(hours=1, seconds=20),
            "expires_at": now - timedelta(hours=1),
            "ttl": 30.0,
        }
    )


# -- release ---------------------------------------------------------------------------------


def test_release_names_the_holder_who_then_loses_the_lock(
    other: LockManager, lock_events: list[tuple[str, Any]]
) -> None:
    lock = other.acquire("report-gen", ttl=30)
    out, err, code = run_command("mongolock", "release", "report-gen", "--force")
    assert (code, err) == (0, "")
    assert out.startswith("Released 'report-gen': held by ")
    assert f"held by {lock.owner} (token {lock.token})" in out
    assert "its lease would have ended in " in out
    assert locks.status("report-gen") is None
    with pytest.raises(LockLost):
        lock.refresh()
    assert not lock.valid
    assert ("lost", lock) in lock_events


def test_release_of_a_missing_lock_exits_1() -> None:
    out, err, code = run_command("mongolock", "release", "nope")
    assert (out, code) == ("", 1)
    assert err == "no lock 'nope'"


def test_release_of_an_expired_lock() -> None:
    _insert_expired("stale")
    out, err, code = run_command("mongolock", "release", "stale")
    assert (code, err) == (0, "")
    assert "Removed the expired lock 'stale': held by gone:1:dead (token 5)" in out
    assert "its lease ended 1h ago" in out
    assert locks.status("stale") is None


def test_release_only_at_a_token(other: LockManager) -> None:
    lock = other.acquire("job", ttl=30)
    out, err, code = run_command("mongolock", "release", "job", "--token", str(lock.token - 1))
    assert (out, code) == ("", 1)
    assert f"lock 'job' now has token {lock.token}, not {lock.token - 1}" in err
    assert lock.owner in err
    assert lock.valid
    out, err, code = run_command(
        "mongolock", "release", "job", "--token", str(lock.token), "--force"
    )
    assert (code, err) == (0, "")
    assert locks.status("job") is None
    _, err, code = run_command("mongolock", "release", "job", "--token", "1")
    assert (code, err) == (1, "no lock 'job'")


def test_release_quietly_and_a_bad_key(other: LockManager) -> None:
    other.acquire("job", ttl=30)
    assert run_command("mongolock", "release", "job", "--force", "--verbosity", "0") == ("", "", 0)
    out, err, code = run_command("mongolock", "release", "")
    assert (out, code) == ("", 2)
    assert "must not be empty" in err


# -- status ----------------------------------------------------------------------------------


def test_status_of_a_live_lock(other: LockManager) -> None:
    lock = other.acquire("report-gen", ttl=30)
    out, err, code = run_command("mongolock", "status", "report-gen")
    assert (code, err) == (0, "")
    fields = dict(line.split(":", 1) for line in out.splitlines())
    fields = {name: value.strip() for name, value in fields.items()}
    assert fields["key"] == "report-gen"
    assert fields["state"] == "live"
    assert fields["owner"] == lock.owner
    assert fields["token"] == str(lock.token)
    assert fields["acquired"].startswith(lock.acquired_at.strftime("%Y-%m-%d %H:%M:%S UTC"))
    assert fields["expires"].startswith(lock.expires_at.strftime("%Y-%m-%d %H:%M:%S UTC"))
    assert fields["expires"].endswith(("(in 29s)", "(in 30s)"))
    assert fields["ttl"] == "30s"
    assert "server time" in fields


def test_status_of_an_expired_lock_exits_0() -> None:
    _insert_expired("stale")
    out, err, code = run_command("mongolock", "status", "stale")
    assert (code, err) == (0, "")
    assert "state:       expired" in out
    assert "expired:     " in out
    assert "(1h ago)" in out


def test_status_json(other: LockManager) -> None:
    lock = other.acquire("report-gen", ttl=30)
    out, err, code = run_command("mongolock", "status", "report-gen", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["key"] == "report-gen"
    assert data["state"] == "live"
    assert (data["owner"], data["token"]) == (lock.owner, lock.token)
    assert data["expires_at"] == lock.expires_at.isoformat()


def test_status_of_a_missing_lock_exits_1() -> None:
    assert run_command("mongolock", "status", "nope") == ("", "no lock 'nope'", 1)
    assert run_command("mongolock", "status", "nope", "--json") == ("", "no lock 'nope'", 1)
    assert run_command("mongolock", "status", "nope", "-v", "0") == ("", "no lock 'nope'", 1)


# -- list ------------------------------------------------------------------------------------


@pytest.fixture
def some_locks(other: LockManager) -> dict[str, Any]:
    held = {key: other.acquire(key, ttl=60) for key in ("invoice-1", "invoice-2", "report-gen")}
    _insert_expired("invoice-0")
    _insert_expired("old-job", owner="cron-7:42:beef", token=7)
    return held


def test_list_live_as_a_table(some_locks: dict[str, Any]) -> None:
    out, err, code = run_command("mongolock", "list")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    header = lines[0].split()
    assert header == ["KEY", "STATE", "OWNER", "TOKEN", "ACQUIRED", "EXPIRES", "PROCESS"]
    rows = lines[1:-1]
    assert [row.split()[0] for row in rows] == ["invoice-1", "invoice-2", "report-gen"]
    for row in rows:
        key, state, owner, token, acquired, *expires, process = row.split()
        lock = some_locks[key]
        assert (state, owner, token) == ("live", lock.owner, str(lock.token))
        assert acquired == "now" or acquired.endswith("s")
        assert " ".join(expires) in ("in 59s", "in 1m")
        assert process == "-"  # no heartbeat yet: the first comes with the first refresh
    # The columns line up with the header.
    assert {row.index(" live ") for row in rows} == {lines[0].index("STATE") - 1}
    assert lines[-1] == "3 live locks"


def test_list_expired_all_prefix_owner_order(some_locks: dict[str, Any]) -> None:
    def keys(*args: str) -> list[str]:
        out, err, code = run_command("mongolock", "list", *args)
        assert (code, err) == (0, "")
        return [line.split()[0] for line in out.splitlines()[1:-1]]

    assert keys("--expired") == ["invoice-0", "old-job"]
    out = run_command("mongolock", "list", "--expired")[0]
    assert "expired" in out.splitlines()[1]
    assert out.splitlines()[1].endswith("1h ago     -")
    assert keys("--all") == ["invoice-0", "invoice-1", "invoice-2", "old-job", "report-gen"]
    assert keys("--all", "--prefix", "invoice-") == ["invoice-0", "invoice-1", "invoice-2"]
    assert keys("--all", "--owner", "cron-7") == ["old-job"]
    assert keys("--live", "--reverse") == ["report-gen", "invoice-2", "invoice-1"]
    assert keys("--all", "--order", "expires")[:2] == ["invoice-0", "old-job"]
    assert keys("--all", "--order", "expires", "--reverse")[-2:] == ["old-job", "invoice-0"]
    _, err, code = run_command("mongolock", "list", "--live", "--expired")
    assert code != 0
    assert "not allowed with argument" in err


def test_list_json_lines(some_locks: dict[str, Any]) -> None:
    out, err, code = run_command("mongolock", "list", "--all", "--json")
    assert (code, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["key"] for row in rows] == [
        "invoice-0",
        "invoice-1",
        "invoice-2",
        "old-job",
        "report-gen",
    ]
    assert [row["state"] for row in rows] == ["expired", "live", "live", "expired", "live"]
    lock = some_locks["invoice-1"]
    assert rows[1]["owner"] == lock.owner
    assert rows[1]["token"] == lock.token
    assert set(rows[1]) >= {
        "key",
        "state",
        "owner",
        "token",
        "acquired_at",
        "refreshed_at",
        "expires_at",
        "ttl",
        "remaining",
        "server_time",
    }


def test_list_empty_and_quiet(some_locks: dict[str, Any]) -> None:
    assert run_command("mongolock", "list", "--prefix", "zzz") == ("No live locks.\n", "", 0)
    assert run_command("mongolock", "list", "--all", "--prefix", "zzz")[0] == "No locks.\n"
    assert run_command("mongolock", "list", "--json", "--prefix", "zzz") == ("", "", 0)
    assert run_command("mongolock", "list", "--all", "-v", "0") == ("", "", 0)


def test_list_streams_100000_locks_in_bounded_memory(
    mongolock_url: str, mongolock_database: str
) -> None:
    total, batch = 100_000, 10_000
    now = datetime.now(UTC)
    collection = locks.store.collection
    for start in range(0, total, batch):
        collection.insert_many(
            [
                {
                    "_id": f"bulk-{i:06d}",
                    "key": f"bulk-{i:06d}",
                    "owner": f"worker-{i % 50}:{1000 + i % 7}:0123456789ab",
                    "token": 7_000_000_000_000_000_000 + i,
                    "acquired_at": now,
                    "refreshed_at": now,
                    "expires_at": now + timedelta(hours=1),
                    "ttl": 3600.0,
                }
                for i in range(start, start + batch)
            ]
        )
    # What holding every row would take: measured on a sample, scaled up (about 50 MB).
    tracemalloc.start()
    try:
        sample = list(itertools.islice(locks.iter_locks("all"), 2000))
        all_rows = tracemalloc.get_traced_memory()[0] / len(sample) * total
    finally:
        tracemalloc.stop()
    del sample

    # The peak memory of real `manage.py` processes (tracemalloc would slow the listing
    # down several times): the listing of 100,000 locks against one of a single lock.
    lines, baseline = _manage(mongolock_url, mongolock_database, "status", "bulk-000000")
    assert lines[0] == "key:         bulk-000000"
    lines, peak = _manage(mongolock_url, mongolock_database, "list", "--all")
    assert len(lines) == total + 2  # header, rows, count
    assert lines[1].startswith("bulk-000000  live     worker-0:1000:0123456789ab  ")
    assert lines[-2].startswith("bulk-099999  live     ")
    assert lines[-1] == f"{total} locks"
    assert peak - baseline < all_rows / 4, (peak, baseline, all_rows)


def _env(url: str, database: str) -> dict[str, str]:
    """The environment of a `manage.py` of the test project on this test's database."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "MONGOLOCK_URL": url,
        "MONGOLOCK_DATABASE": database,
    }


def _manage(url: str, database: str, *args: str) -> tuple[list[str], int]:
    """Run `manage.py mongolock ARGS`; its output lines and its peak memory in bytes."""
    with subprocess.Popen(
        [sys.executable, "manage.py", "mongolock", *args],
        cwd=ROOT,
        env=_env(url, database),
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        lines = [line.rstrip("\n") for line in process.stdout]
        _, status, usage = os.wait4(process.pid, 0)  # Popen.wait() does not tell the memory
        process.returncode = os.waitstatus_to_exitcode(status)
    assert process.returncode == 0
    return lines, usage.ru_maxrss * 1024  # kilobytes on Linux


def test_list_into_a_closed_pipe_stops_quietly(mongolock_url: str, mongolock_database: str) -> None:
    now = datetime.now(UTC)
    locks.store.collection.insert_many(
        [
            {
                "_id": f"row-{i:05d}",
                "key": f"row-{i:05d}",
                "owner": "host:1:abc",
                "token": i + 1,
                "acquired_at": now,
                "refreshed_at": now,
                "expires_at": now + timedelta(hours=1),
                "ttl": 3600.0,
            }
            for i in range(5000)
        ]
    )
    process = subprocess.Popen(
        [sys.executable, "manage.py", "mongolock", "list"],
        cwd=ROOT,
        env=_env(mongolock_url, mongolock_database),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stdout.readline().startswith(b"KEY")  # like `| head -1`
    process.stdout.close()
    _, err = process.communicate(timeout=60)
    assert without_slow_server_warnings(err.decode()) == ""
    assert process.returncode == 0


# -- help, usage and errors ------------------------------------------------------------------


def test_help_shows_subcommands_examples_and_exit_codes() -> None:
    parser = Command().create_parser("manage.py", "mongolock")
    text = parser.format_help()
    for needle in ("release", "list", "status", "history", "examples:", "mongolock list --all"):
        assert needle in text
    assert "exit status:\n  0   done\n  1   no such lock" in text
    assert "  3   (release) the lease is live and its holder is not known to be dead" in text
    assert "  75  " in text
    actions = [action for action in parser._actions if action.dest == "subcommand"]
    subparsers = actions[0].choices
    assert isinstance(subparsers, dict)
    for name in ("release", "list", "status", "history"):
        sub = subparsers[name].format_help()
        assert "exit status:" in sub
    listing = subparsers["list"].format_help()
    for option in ("--live", "--expired", "--all", "--prefix", "--json", "--order"):
        assert option in listing


def test_a_subcommand_is_required() -> None:
    _, err, code = run_command("mongolock")
    assert code != 0
    assert "subcommand" in err


@pytest.mark.parametrize(
    "args",
    [
        ("list",),
        ("list", "--json"),
        ("list", "-v", "0"),
        ("status", "k"),
        ("release", "k"),
        ("release", "k", "--force"),
        ("history", "k"),
    ],
)
def test_server_errors_exit_2(settings: Settings, args: tuple[str, ...]) -> None:
    settings.MONGOLOCK = {"URL": "mongodb://127.0.0.1:9/", "SERVER_SELECTION_TIMEOUT": 0.3}
    out, err, code = run_command("mongolock", *args)
    assert (out, code) == ("", 2)
    assert "MongoDB at 127.0.0.1:9 did not answer" in err


def test_invalid_settings_exit_2(settings: Settings) -> None:
    settings.MONGOLOCK = {"URL": "mongodb://127.0.0.1:9/", "TTL": -1}
    _, err, code = run_command("mongolock", "list")
    assert code == 2
    assert "invalid MONGOLOCK settings" in err


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.4, "now"),
        (-0.9, "now"),
        (12.7, "in 12s"),
        (-59.9, "59s ago"),
        (60, "in 1m"),
        (-185, "3m ago"),
        (7200, "in 2h"),
        (-86400 * 3 - 5, "3d ago"),
    ],
)
def test_relative_times(seconds: float, text: str) -> None:
    assert _relative(seconds) == text


# -- hostile keys and owners -------------------------------------------------------------------

# What a terminal would act on: C0 controls (newline, carriage return, ESC), DEL, C1
# controls (0x9b is a one-byte CSI), and the bidi overrides and isolates.
TERMINAL_CONTROLS = frozenset(
    map(chr, [*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)])
)
HOSTILE_KEYS = {
    "\x1b[2J": r"\x1b[2J",
    "a\nfake-row  live  root:1:ffff  1  now  in 9s": r"a\nfake-row",
    "over\rwrite": r"over\rwrite",
    "\u202eevil-key": r"\u202eevil-key",
    "csi\x9b31m\x7f": r"csi\x9b31m\x7f",
}
HOSTILE_OWNER = "owner\x1b]0;pwned\x07\n\u2066x"


def _raw_controls(text: str) -> set[str]:
    """The terminal controls in ``text``, newlines between lines of output left aside."""
    return {char for line in text.split("\n") for char in line} & TERMINAL_CONTROLS


@pytest.fixture
def hostile(mongolock_url: str, manager: LockManager) -> Any:
    """Locks with hostile keys held by a holder with a hostile owner name, for the test."""
    evil = LockManager(
        mongolock_url, database=manager.database, collection=manager.collection, owner=HOSTILE_OWNER
    )
    held = [evil.acquire(key, ttl=30) for key in HOSTILE_KEYS]
    shared = evil.acquire("shared\nkey", ttl=30, shared=True, limit=3)
    yield [*held, shared]
    evil.close()


def test_list_escapes_what_a_terminal_would_act_on(hostile: list[Any]) -> None:
    out, err, code = run_command("mongolock", "list")
    assert (code, err) == (0, "")
    assert _raw_controls(out) == set()
    lines = out.splitlines()
    assert len(lines) == 1 + len(hostile) + 1  # header, one row per lock, the count
    assert lines[-1] == f"{len(hostile)} live locks"
    for shown in HOSTILE_KEYS.values():
        assert sum(line.startswith(shown) for line in lines) == 1
    assert r"owner\x1b]0;pwned\x07\n\u2066x:" in out
    assert r"shared\nkey" in out


def test_status_and_release_escape_keys_and_owners(hostile: list[Any]) -> None:
    for lock in hostile:
        out, err, code = run_command("mongolock", "status", lock.key)
        assert (code, err) == (0, "")
        assert _raw_controls(out) == set()
        assert r"owner\x1b]0;pwned\x07\n\u2066x:" in out
    lock = hostile[0]
    out, err, code = run_command("mongolock", "release", lock.key, "--token", str(lock.token + 1))
    assert code == 1
    assert _raw_controls(err) == set()
    assert r"held by owner\x1b]0;pwned\x07\n\u2066x:" in err
    out, err, code = run_command("mongolock", "release", lock.key, "--force")
    assert (code, err) == (0, "")
    assert _raw_controls(out) == set()
    assert out.startswith(r"Released '\x1b[2J': held by owner\x1b]0;pwned\x07\n\u2066x:")


def test_json_keeps_keys_and_owners_exact_in_ascii(hostile: list[Any]) -> None:
    out, err, code = run_command("mongolock", "list", "--json")
    assert (code, err) == (0, "")
    assert out.isascii()
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == len(hostile)
    assert {row["key"] for row in rows} == {lock.key for lock in hostile}
    assert {row["owner"] for row in rows if row["mode"] == "exclusive"} == {
        lock.owner for lock in hostile if not lock.shared
    }
    shared = next(lock for lock in hostile if lock.shared)
    out, _, code = run_command("mongolock", "status", shared.key, "--json")
    assert code == 0
    assert out.isascii()
    assert json.loads(out)["holders"][0]["owner"] == shared.owner


# -- holder liveness, --force, --reason and history ------------------------------------------


def _me() -> str:
    """The effective user's name, as the audit trail records it."""
    return pwd.getpwuid(os.geteuid()).pw_name


def _alive(manager: LockManager, key: str) -> Any:
    """Hold ``key`` until the refresher has sent a heartbeat (bounded): a lease short
    enough that the first tick comes soon, long enough that a late tick keeps it."""
    lock = manager.acquire(key, ttl=2.0)
    deadline = clock.now() + 10
    while not getattr(locks.status(key), "holder_alive", False):
        assert clock.now() < deadline, "no heartbeat within 10s"
        time.sleep(0.05)
    return lock


def test_release_refuses_while_the_holder_process_is_alive(other: LockManager) -> None:
    lock = _alive(other, "job")
    out, err, code = run_command("mongolock", "release", "job")
    assert (out, code) == ("", 3)
    assert f"lock 'job' is held by {lock.owner} (token {lock.token}), whose process is alive" in err
    assert "nothing released" in err
    assert "--force" in err
    assert lock.valid
    assert locks.history("job") == []
    out, err, code = run_command(
        "mongolock", "release", "job", "--force", "--reason", "stuck since noon", "-v", "2"
    )
    assert (code, err) == (0, "")
    assert out.startswith(f"Released 'job': held by {lock.owner} (token {lock.token})")
    assert "Recorded in the audit trail: stuck since noon." in out
    assert locks.status("job") is None
    [entry] = locks.history("job")
    assert (entry.owner, entry.token, entry.reason) == (lock.owner, lock.token, "stuck since noon")
    assert entry.by == f"{_me()}@{socket.gethostname()}"


def test_release_of_an_unknown_or_dead_holder_proceeds_and_is_recorded() -> None:
    _insert_expired("stale")
    locks.store.processes.insert_one(
        {
            "_id": "gone:1",
            "seen_at": datetime.now(UTC) - timedelta(hours=1),
            "alive_until": datetime.now(UTC) - timedelta(minutes=59),
            "interval": 10.0,
        }
    )
    assert locks.status("stale").holder_alive is False  # type: ignore[union-attr]
    _out, err, code = run_command("mongolock", "release", "stale", "--reason", "cleanup")
    assert (code, err) == (0, "")
    [entry] = locks.history("stale")
    assert (entry.owner, entry.token, entry.reason, entry.expired) == (
        "gone:1:dead",
        5,
        "cleanup",
        True,
    )


def test_status_and_list_show_the_holder_process(other: LockManager) -> None:
    lock = _alive(other, "job")
    out, err, code = run_command("mongolock", "status", "job")
    assert (code, err) == (0, "")
    assert "process:     alive (last heartbeat " in out
    data = json.loads(run_command("mongolock", "status", "job", "--json")[0])
    assert data["holder_alive"] is True
    assert 0 <= data["holder_silent_for"] < 10
    out = run_command("mongolock", "list")[0]
    assert out.splitlines()[1].split()[-1] == "alive"
    [row] = [
        json.loads(line) for line in run_command("mongolock", "list", "--json")[0].splitlines()
    ]
    assert (row["owner"], row["holder_alive"]) == (lock.owner, True)
    _insert_expired("stale")
    out = run_command("mongolock", "status", "stale")[0]
    assert "process:     unknown (no heartbeat on record)" in out
    assert (
        json.loads(run_command("mongolock", "status", "stale", "--json")[0])["holder_alive"] is None
    )


def test_history_table_json_and_none(other: LockManager) -> None:
    assert run_command("mongolock", "history", "job") == (
        "No force releases of 'job' on record.\n",
        "",
        0,
    )
    assert run_command("mongolock", "history", "job", "--json") == ("", "", 0)
    first = other.acquire("job", ttl=30)
    locks.force_release("job", reason="first", by="alice@admin")
    second = other.acquire("job", ttl=30)
    run_command("mongolock", "release", "job", "--force")
    out, err, code = run_command("mongolock", "history", "job")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["WHEN", "BY", "OWNER", "TOKEN", "REASON"]
    newest, oldest = lines[1].split(), lines[2].split()
    assert newest[3:] == [
        f"{_me()}@{socket.gethostname()}",
        second.owner,
        str(second.token),
        "-",
    ]
    assert oldest[3:] == ["alice@admin", first.owner, str(first.token), "first"]
    assert lines[-1] == "2 force releases"
    rows = [
        json.loads(line)
        for line in run_command("mongolock", "history", "job", "--json")[0].splitlines()
    ]
    assert [row["token"] for row in rows] == [second.token, first.token]
    assert rows[1] == {
        "key": "job",
        "owner": first.owner,
        "token": first.token,
        "by": "alice@admin",
        "reason": "first",
        "at": rows[1]["at"],
        "expired": False,
    }
    assert (
        len(run_command("mongolock", "history", "job", "--limit", "1", "--json")[0].splitlines())
        == 1
    )
    _, err, code = run_command("mongolock", "history", "job", "--limit", "-1")
    assert code == 2
    assert "limit" in err
    _, err, code = run_command("mongolock", "history", "")
    assert code == 2
    assert "must not be empty" in err


def test_history_escapes_what_a_terminal_would_act_on(hostile: list[Any]) -> None:
    lock = hostile[0]
    reason = "\x1b[2Jwiped\nfake row"
    out, err, code = run_command(
        "mongolock", "release", lock.key, "--force", "--reason", reason, "-v", "2"
    )
    assert (code, err) == (0, "")
    assert _raw_controls(out) == set()
    out, err, code = run_command("mongolock", "history", lock.key)
    assert (code, err) == (0, "")
    assert _raw_controls(out) == set()
    assert r"owner\x1b]0;pwned\x07\n\u2066x:" in out
    assert r"\x1b[2Jwiped\nfake row" in out
    assert len(out.splitlines()) == 3
    out = run_command("mongolock", "history", lock.key, "--json")[0]
    assert out.isascii()
    assert json.loads(out)["reason"] == reason


def test_release_with_a_bad_reason_changes_nothing(other: LockManager) -> None:
    other.acquire("job", ttl=30)
    _, err, code = run_command("mongolock", "release", "job", "--force", "--reason", "x" * 1001)
    assert code == 2
    assert "reason must be" in err
    assert locks.status("job") is not None
    assert locks.history("job") == []


@pytest.mark.parametrize(
    ("key", "how"),
    [
        ("fresh", {"ttl": 30}),  # the first heartbeat comes a third of the ttl later
        ("kept", {"ttl": 30, "refresh": False}),  # no refresher, no heartbeat
        ("read", {"ttl": 30, "shared": True}),
    ],
)
def test_release_refuses_a_live_lease_whose_holder_is_not_known_to_be_dead(
    other: LockManager, key: str, how: dict[str, Any]
) -> None:
    lock = other.acquire(key, **how)
    assert locks.status(key).holder_alive is not False  # type: ignore[union-attr]
    out, err, code = run_command("mongolock", "release", key)
    assert (out, code) == ("", 3)
    assert f"lock {key!r} is held by " in err
    assert "not known to be dead" in err or "whose process is alive" in err
    assert "nothing released" in err
    assert "--force" in err
    assert lock.valid
    assert locks.status(key) is not None
    assert locks.history(key) == []
    out, err, code = run_command("mongolock", "release", key, "--force")
    assert (code, err) == (0, "")
    assert locks.status(key) is None


def test_the_audit_record_names_the_real_user_not_logname(
    other: LockManager, mongolock_url: str, mongolock_database: str
) -> None:
    other.acquire("spoofed", ttl=30)
    env = {
        **_env(mongolock_url, mongolock_database),
        "LOGNAME": "spoof",
        "USER": "spoof",
        "LNAME": "spoof",
        "USERNAME": "spoof",
    }
    env.pop("SUDO_USER", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "mongolock", "release", "spoofed", "--force"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    [entry] = locks.history("spoofed")
    assert entry.by == f"{_me()}@{socket.gethostname()}"
    assert "spoof" not in entry.by
    env["SUDO_USER"] = "alice"
    other.acquire("spoofed", ttl=30)
    done = subprocess.run(
        [sys.executable, "manage.py", "mongolock", "release", "spoofed", "--force"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    newest = locks.history("spoofed")[0]
    assert newest.by == f"{_me()}@{socket.gethostname()} (sudo from alice)"
