"""The contention statistics and the admin's views of them, against the real replica set:
what the locks of a process count, the flush in the refresher's tick, the bounded
collection, the contention page (charts and their table) and a key's line and history."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from django_mongolock import LockManager, events, stats
from django_mongolock.notices import get_notices
from django_mongolock.queries import stats as queries
from django_mongolock.refresher import get_refresher
from django_mongolock.store.stats import StatsStore
from tests.waiting import Waiter

pytestmark = pytest.mark.django_db

LIST_URL = "/admin/django_mongolock/lock/"
CONTENTION_URL = f"{LIST_URL}contention/"


@pytest.fixture
def locks(mongolock_settings: dict[str, Any], manager: LockManager) -> LockManager:
    manager.ensure_indexes()
    return manager


@pytest.fixture
def recorder() -> Iterator[stats.Recorder]:
    """The process's recorder, installed (the admin installs it at import), emptied after."""
    stats.install()
    yield stats.get_recorder()
    stats.get_recorder()._pending.clear()


def _until(test: Any, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not test():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _stats(manager: LockManager) -> StatsStore:
    return stats.stats_store(manager.store)


# -- without a server -------------------------------------------------------------------------


def test_a_flush_adds_counts_per_key_and_minute_with_bounded_events() -> None:
    minute = queries.bucket_of(125.0)
    assert minute == datetime(1970, 1, 1, 0, 2, tzinfo=UTC)
    bucket = queries.Bucket({"acquired": 3, "waited": 1, "lost": 0}, 1500, {"expired": 1})
    bucket.events = [{"kind": "lost", "at": minute}] * 30
    [total, write] = queries.flush({("reports/daily", minute): bucket})
    assert total._filter == {"_id": {"t": minute}}  # the minute's total, for the charts
    total_doc: Any = total._doc
    assert total_doc["$inc"] == {"acquired": 3, "waited": 1}
    doc: Any = write._doc
    assert write._filter == {"_id": {"k": "reports/daily", "t": minute}}
    assert doc["$inc"] == {"acquired": 3, "waited": 1, "lost_by.expired": 1, "score": 1}
    assert doc["$max"] == {"wait_max_ms": 1500}
    assert doc["$setOnInsert"] == {"key": "reports/daily", "at": minute}
    assert doc["$push"]["events"]["$slice"] == -queries.EVENTS_KEEP


def test_the_recorder_keeps_the_busiest_keys_and_sums_up_the_rest() -> None:
    recorder = stats.Recorder(max_buffered=50)
    source = LockManager.__new__(LockManager)  # a weak-referenceable source; no I/O here
    at = 1_000_000.0
    for i in range(60):  # more keys than it buffers: the last ten go to "other keys"
        recorder.acquire(source, f"k{i}", "acquired", at=at)
    recorder.acquire(source, "k7", "timeout", wait=2.0, owner="h:1:x", at=at)
    assert recorder.pending(source) == 51
    taken = recorder.take(source)
    minute = queries.bucket_of(at)
    assert taken[(queries.OTHER_KEYS, minute)].counts == {"acquired": 10}
    assert taken[("k7", minute)].counts == {"acquired": 1, "timeouts": 1, "wait_ms": 2000}
    [event] = taken[("k7", minute)].events
    assert event["kind"] == "timeout"
    assert event["wait_ms"] == 2000
    assert recorder.pending(source) == 0

    many = stats.Recorder(max_buffered=1000)
    for i in range(queries.MAX_KEYS + 30):
        many.acquire(source, f"k{i}", "acquired", at=at)
    many.acquire(source, "k120", "busy", at=at)  # contention ranks first
    cut = many.take(source)
    assert len(cut) == queries.MAX_KEYS + 1
    assert ("k120", minute) in cut
    assert cut[(queries.OTHER_KEYS, minute)].counts["acquired"] == 30


def test_a_minute_writes_at_most_max_keys_across_flushes() -> None:
    recorder = stats.Recorder()
    source = LockManager.__new__(LockManager)
    at = 1_000_000.0
    minute = queries.bucket_of(at)
    first = [f"a{i}" for i in range(60)]
    for key in first:
        recorder.acquire(source, key, "acquired", at=at)
    assert len(recorder.take(source)) == 60  # room for all of them
    # The same minute, a later flush: 60 new keys and 5 already written.
    second = [f"b{i}" for i in range(60)]
    for key in second:
        recorder.acquire(source, key, "acquired", at=at)
    recorder.acquire(source, "b7", "busy", at=at)  # the busiest new key gets a place
    for key in first[:5]:
        recorder.acquire(source, key, "acquired", at=at)
    cut = recorder.take(source)
    kept = {key for key, _ in cut} - {queries.OTHER_KEYS}
    assert set(first[:5]) <= kept  # their documents exist already: no new one
    assert "b7" in kept
    assert len(kept - set(first)) == queries.MAX_KEYS - 60
    assert cut[(queries.OTHER_KEYS, minute)].counts["acquired"] == 60 - (queries.MAX_KEYS - 60)
    # The next minute starts with all its room.
    for key in second:
        recorder.acquire(source, key, "acquired", at=at + 60)
    assert len(recorder.take(source)) == 60


def test_a_recorder_that_never_flushes_stays_bounded() -> None:
    recorder = stats.Recorder(max_buffered=10)
    source = LockManager.__new__(LockManager)
    at = 1_000_000.0
    for i in range(10):
        recorder.acquire(source, f"k{i}", "acquired", at=at)
    minutes = 3 * queries.STATS_RETENTION // queries.BUCKET_SECONDS
    for m in range(1, minutes):  # a new key each minute for six hours, no tick
        recorder.acquire(source, f"late{m}", "acquired", at=at + 60 * m)
    # The first keys are older than the collection keeps: gone; one "other keys" a minute.
    kept = queries.STATS_RETENTION // queries.BUCKET_SECONDS + 1
    assert recorder.pending(source) == kept
    taken = recorder.take(source)
    assert {key for key, _ in taken} == {queries.OTHER_KEYS}
    assert min(minute for _, minute in taken) >= queries.bucket_of(at + 60 * (minutes - kept))


# -- recorded by real locks -------------------------------------------------------------------


def _contend(manager: LockManager, other: LockManager, key: str) -> None:
    """One acquisition that waits about 0.3 s, one refusal, one timeout."""
    # Counts are kept per minute: start far enough from the next minute that all of
    # this (a second or two) is counted in one.
    into_minute = time.time() % 60
    if into_minute > 45:
        time.sleep(60.5 - into_minute)
    holder = manager.acquire(key, ttl=30)
    waiter = Waiter(manager, other, key, timeout=20)
    time.sleep(0.3)
    holder.release()
    waiter.join()
    blocker = manager.acquire(key, ttl=30)
    with pytest.raises(Exception, match="held"):
        other.acquire(key, blocking=False)
    with pytest.raises(Exception, match="held"):
        other.acquire(key, timeout=0.1)
    blocker.release()


def test_counts_are_flushed_in_the_refreshers_tick_into_a_ttl_collection(
    locks: LockManager, other: LockManager, recorder: stats.Recorder
) -> None:
    _contend(locks, other, "orders/sync")
    assert recorder.pending(other) == 1
    assert recorder.pending(locks) == 1
    store = _stats(locks)
    assert store.stats.count_documents({}) == 0  # nothing is written outside a tick
    kept = locks.acquire("keeps/the-lane-busy", ttl=30)
    kept2 = other.acquire("keeps/the-other-lane-busy", ttl=30)
    try:
        get_refresher().tick()
        assert get_notices().drain(5.0)  # the flush follows the tick on a notice worker
        assert recorder.pending(other) == 0
        assert recorder.pending(locks) == 0
    finally:
        kept.release()
        kept2.release()
    [doc] = store.stats.find({"key": "orders/sync"})
    assert doc["score"] == 3  # one wait, one refusal, one timeout
    assert doc["acquired"] == 3  # the holder, the waiter (after waiting), the blocker
    assert doc["waited"] == 1
    assert doc["wait_ms"] >= 250
    assert doc["busy"] == 1
    assert doc["timeouts"] == 1
    assert doc["released"] == 3
    kinds = [event["kind"] for event in doc["events"]]
    # The release handed the lock to the waiter, which learnt of it from its change
    # stream or found it its own at its next attempt: one handoff either way (none if
    # the waiter stalled past its first lease and then took the key itself).
    assert [kind for kind in kinds if kind != "handoff"] == ["timeout"]
    assert doc.get("handoffs", 0) == kinds.count("handoff") <= 1
    assert store.wait_indexed(30.0)  # created by the first flush, on a thread of its own
    index = store.stats.index_information()[queries.STATS_TTL_INDEX]
    assert index["expireAfterSeconds"] == queries.STATS_RETENTION
    assert store.check_index().action == "unchanged"


def test_an_unreachable_or_slow_tick_writes_nothing(
    locks: LockManager, recorder: stats.Recorder
) -> None:
    recorder.acquire(locks, "a", "acquired")
    stats.observe(events.RefresherTick(locks, 0.01, 0.0, 1, 10.0, False), recorder)
    assert recorder.pending(locks) == 1  # kept for a tick that reaches the server
    stats.observe(events.RefresherTick(locks, 6.0, 0.0, 1, 10.0, True), recorder)
    stats.observe(events.RefresherTick(locks, 0.01, 6.0, 1, 10.0, True), recorder)
    assert recorder.pending(locks) == 1  # and for one that is not slow or late
    stats.observe(events.RefresherTick(locks, 0.01, 0.0, 1, 10.0, True), recorder)
    assert recorder.pending(locks) == 0
    assert _stats(locks).stats.count_documents({"key": "a"}) == 1


# -- the pages ----------------------------------------------------------------------------------


def _seed(manager: LockManager, now: datetime) -> None:
    """Counts of three keys over the last minutes, as two processes would flush them."""
    recorder = stats.Recorder()
    t = now.timestamp()
    for minute in range(5):
        for _ in range(4):
            recorder.acquire(manager, "orders/sync", "acquired", wait=1.5, at=t - minute * 60)
        recorder.acquire(manager, "reports/daily", "acquired", at=t - minute * 60)
    recorder.acquire(manager, "mail/digest", "busy", at=t)
    recorder.lost(manager, "orders/sync", "expired", owner="web-1:42:ab", token=1234567, at=t - 30)
    recorder.handoff(manager, "orders/sync", owner="web-2:7:cd", token=1234568, at=t - 20)
    _stats(manager).add(recorder.take(manager))


def test_the_contention_view_charts_and_tables_the_busiest_keys(
    admin_client: Client, locks: LockManager, other: LockManager
) -> None:
    now = datetime.now(UTC)
    _seed(locks, now)
    holder = locks.acquire("orders/sync", ttl=30)
    try:
        waiter = Waiter(locks, other, "orders/sync", timeout=20)
        response = admin_client.get(CONTENTION_URL)
    finally:
        holder.release()
    waiter.join()
    assert response.status_code == 200
    html = response.content.decode()
    assert html.count('<svg class="mongolock-chart"') == 3
    assert "<title>Acquisitions per minute</title>" in html
    rows = re.findall(r"<tr>\s*<th scope=\"row\"><a href=\"([^\"]+)\"[^>]*>([^<]+)</a>", html)
    # Busiest first: waits and a loss rank orders/sync first, the refusal mail/digest next.
    assert [key for _, key in rows[:3]] == ["orders/sync", "mail/digest", "reports/daily"]
    assert rows[0][0] == f"{LIST_URL}orders_2Fsync/change/"
    table = html[html.index('id="mongolock-busiest"') :]
    first = table[: table.index("</tr>", table.index("<tbody>"))]
    cells = re.findall(r'<td class="mongolock-num[^"]*">([^<]*)</td>', first)
    # acquired, after waiting, mean wait, longest wait, busy, timed out, lost, handed over, now
    assert cells == ["20", "20", "1.5 s", "1.5 s", "0", "0", "1", "1", "1"]
    waiting = html[html.index('id="mongolock-waiting-now"') :]
    assert re.search(r"orders/sync</a></th><td class=\"mongolock-num\">1</td>", waiting)
    assert "The same numbers, minute by minute" in html
    minute_rows = re.findall(r'<time datetime="[^"]+">(\d\d:\d\d)</time>', html)
    assert len(minute_rows) == 5
    # The list links to it.
    assert (
        'href="/admin/django_mongolock/lock/contention/"'
        in admin_client.get(LIST_URL).content.decode()
    )


def test_the_contention_view_needs_the_view_permission(
    client: Client, locks: LockManager, django_user_model: Any
) -> None:
    client.force_login(django_user_model.objects.create_user("staff", is_staff=True))
    assert client.get(CONTENTION_URL).status_code == 403


def test_a_keys_page_shows_its_hour_and_its_history(
    admin_client: Client, locks: LockManager
) -> None:
    _seed(locks, datetime.now(UTC))
    holder = locks.acquire("orders/sync", ttl=30, refresh=False)
    locks.force_release("orders/sync", token=holder.token, reason="stuck", by="ops")
    locks.acquire("orders/sync", ttl=30, refresh=False)
    page = admin_client.get(f"{LIST_URL}orders_2Fsync/change/").content.decode()
    assert "Nobody waits for this key." in page
    history = page[page.index('id="mongolock-events"') :]
    history = history[: history.index("</table>")]
    kinds = re.findall(r'<tr class="mongolock-event-([a-z-]+)">', history)
    assert kinds == ["force-release", "handoff", "lost"]  # newest first
    assert "by ops" in history
    assert "stuck" in history
    assert "expired" in history
    assert "1234567" in history
    assert "web-2:7:cd" in history
    assert page.count('<svg class="mongolock-chart"') == 3
    assert re.search(r"<strong>20</strong> acquisitions", page)


def test_a_line_of_waiters_in_order(admin_client: Client, locks: LockManager) -> None:
    past = datetime.now(UTC) + timedelta(seconds=30)
    locks.store.collection.insert_one(
        {
            "_id": "queue/k",
            "owner": "web-1:4242:aa",
            "token": 5,
            "acquired_at": past - timedelta(seconds=40),
            "refreshed_at": past - timedelta(seconds=40),
            "expires_at": past,
            "ttl": 60.0,
            "waiters": [
                {"owner": "web-2:7:bb", "until": past + timedelta(seconds=2)},
                {"owner": "gone:1:cc", "until": past - timedelta(seconds=300)},
                {"owner": "web-3:8:dd", "until": past + timedelta(seconds=2), "shared": True},
            ],
        }
    )
    page = admin_client.get(f"{LIST_URL}queue_2Fk/change/").content.decode()
    line = page[
        page.index('id="mongolock-line"') : page.index(
            "</table>", page.index('id="mongolock-line"')
        )
    ]
    hosts = re.findall(r'<td class="mongolock-mono" title="([^"]+)">', line)
    assert hosts == ["web-2:7:bb", "web-3:8:dd"]  # the lapsed place is not shown
    assert re.findall(r"<td>(shared|exclusive)</td>", line) == ["exclusive", "shared"]


def test_a_short_process_leaves_its_counts_at_exit(locks: LockManager, mongolock_url: str) -> None:
    """A cron-like process refused at once, which exits before any refresher tick."""
    holder = locks.acquire("nightly/report", ttl=30, refresh=False)
    program = (
        "import sys\n"
        "from django_mongolock import LockManager, LockNotAcquired, stats\n"
        "stats.install()\n"
        f"m = LockManager({mongolock_url!r}, database={locks.database!r})\n"
        "try:\n"
        "    m.acquire('nightly/report', blocking=False)\n"
        "except LockNotAcquired:\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    holder.release()
    assert done.returncode == 3, done.stderr
    [doc] = _stats(locks).stats.find({"key": "nightly/report"})
    assert doc["busy"] == 1


def test_the_contention_view_with_nothing_recorded(
    admin_client: Client, locks: LockManager
) -> None:
    html = admin_client.get(CONTENTION_URL).content.decode()
    assert "No acquisitions recorded in this window." in html
    assert "Nobody waits for a lock now." in html
    assert html.count('<svg class="mongolock-chart"') == 3  # empty axes, no bars
    assert "<rect" not in html


def test_keys_are_escaped_in_charts_and_tables(admin_client: Client, locks: LockManager) -> None:
    hostile = '<script>alert(1)</script>"&'
    recorder = stats.Recorder()
    recorder.acquire(locks, hostile, "busy")
    _stats(locks).add(recorder.take(locks))
    html = admin_client.get(CONTENTION_URL).content.decode()
    assert "<script>alert(1)" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&amp;" in html
