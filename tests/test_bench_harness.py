"""The benchmark harness itself: its worker pool, its safety counts, its connecting step
and its warm-up waves, against the session's replica set. A harness that miscounts, or
hangs after a failed round, would publish figures nobody should trust."""

from __future__ import annotations

import itertools
import math
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pymongo import MongoClient, uri_parser
from pymongo.collection import Collection
from pymongo.errors import (
    AutoReconnect,
    ExecutionTimeout,
    PyMongoError,
    ServerSelectionTimeoutError,
)

from benchmarks import (
    arrival_load,
    client_cpu,
    handing_write,
    handoff_parts,
    line_cost,
    report,
    scale,
    sections,
    servers,
    think_time,
    tick_cpu,
    workers,
)
from benchmarks.contenders import DATABASE, FloorLock, Kind, OurLock, Spec, build
from benchmarks.goals import targets
from benchmarks.idle_streams import held_open
from benchmarks.labels import FLOOR_POLL_10, OURS
from benchmarks.refreshing import _time_ticks
from benchmarks.scale import after_arrival, waves
from benchmarks.stats import summary, table
from benchmarks.workers import Job, Pool, Shared
from django_mongolock import LockNotAcquired, ServerUnavailable, lanes
from django_mongolock.queries import head_owner
from django_mongolock.refresher import get_refresher
from django_mongolock.testing import MongoReplicaSet
from tests.commands import RecordedManager, Recorder
from tests.reliability.proxy import TcpProxy
from tests.waiting import until


@pytest.fixture
def bench_database(mongolock_url: str) -> Iterator[None]:
    """The harness writes to its own database on the test server: the collections these
    tests name (``harness_...``) are dropped after, nothing else in it."""
    yield
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        database = client[DATABASE]
        for name in database.list_collection_names(filter={"name": {"$regex": "^harness_"}}):
            database.drop_collection(name)
    finally:
        client.close()


@pytest.fixture
def nowhere() -> Iterator[socket.socket]:
    """A local port bound but not listening: every connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


def _url(port: int) -> str:
    return (
        f"mongodb://127.0.0.1:{port}/?directConnection=true"
        "&serverSelectionTimeoutMS=300&connectTimeoutMS=300"
    )


def test_the_warm_up_waves_halve_the_size_asked_down_to_the_first() -> None:
    assert waves(200) == [4, 6, 12, 25, 50, 100, 200]
    assert waves(48) == [4, 6, 12, 24, 48]
    assert waves(5) == [4, 5]
    assert waves(4) == [4]
    assert waves(2) == [2]  # fewer than the first wave: one wave of them all
    assert waves(16, first=8) == [8, 16]


def test_after_arrival_keeps_the_releases_that_began_once_every_process_asked() -> None:
    """Process 1 asks last (at 4.0; that call timed out, its next one at 4.5 returned):
    the release that began before (at 3.0) is neither a release nor the start of a
    wake-up counted after arrival, but the one release during it; the three releases
    after it are, and the two wake-ups that follow them. Process 3 asked too, and never
    got the key."""
    workers = [
        # (asked, returned from acquire, release called, release returned)
        {"worker": 0, "asked": 0.0, "records": [(0.0, 2.0, 3.0, 3.5), (6.0, 7.0, 8.0, 8.25)]},
        {"worker": 1, "asked": 4.0, "records": [(4.5, 5.0, 6.0, 6.5)]},
        {"worker": 2, "asked": 1.0, "records": [(1.0, 9.0, 10.0, 10.75)]},
        {"worker": 3, "asked": 0.5, "records": []},
    ]
    arrival, wakes, releases, arriving = after_arrival(workers)
    assert arrival == 4.0
    assert wakes == [7.0 - 6.0, 9.0 - 8.0]
    assert releases == [0.5, 0.25, 0.75]
    assert arriving == [0.5]


def test_a_release_counts_in_the_arrival_by_when_it_was_called() -> None:
    """Not by when it returned, nor by when its holder got the key: a release called
    before the last process asked (at 4.0) and returned after it is during the arrival;
    one called at 4.0 by a holder that got the key before it, or called after it, is
    not. Every release is on one side."""
    workers = [
        {"worker": 0, "asked": 0.0, "records": [(0.0, 3.5, 3.75, 4.25), (5.0, 5.5, 6.0, 6.125)]},
        {"worker": 1, "asked": 4.0, "records": [(4.0, 4.5, 5.0, 5.0625)]},
        {"worker": 2, "asked": 1.0, "records": [(1.0, 3.875, 4.0, 4.25), (4.25, 4.375, 4.5, 5.5)]},
        {"worker": 3, "asked": 2.0, "records": [(2.0, 3.0, 3.25, 3.375)]},
    ]
    _arrival, _wakes, releases, arriving = after_arrival(workers)
    assert sorted(arriving) == [0.125, 0.5]
    assert sorted(releases) == [0.0625, 0.125, 0.25, 1.0]


def test_the_scale_table_gives_the_release_p50_during_arrival() -> None:
    """With how many releases it counts; none when none began before every process asked,
    n/a in results recorded before it was measured."""
    point = {
        "waiters": 4,
        "wake": {"p50": 0.001, "p99": 0.002},
        "wake_settled": {"p99": 0.002},
        "release": {"p50": 0.0015},
        "release_arriving": summary([0.004, 0.012, 0.020]),
        "arrival": 0.3,
        "ops": dict.fromkeys(scale.COUNTED, 0),
        **scale._per_release(dict.fromkeys(scale.COUNTED, 0), 1),
        "cursors": 0,
    }
    calm = {**point, "waiters": 16, "release_arriving": summary([])}
    old = {key: value for key, value in point.items() if key != "release_arriving"}
    data = {"hold": 0.005, "seconds": 3.0, "cores": 2}
    lines = scale.render({**data, "processes": {"points": {"4": point, "16": calm}}}, None)
    lines += scale.render({**data, "relay": {"points": {"4": old}}}, None)
    header = next(line for line in lines if line.startswith("| shape |"))
    column = header.split(" | ").index("release p50 during arrival")
    rows = [line for line in lines if line.startswith(("| processes |", "| relay |"))]
    assert [row.split(" | ")[column] for row in rows] == ["12.00 ms (3)", "none", "n/a"]
    assert "during it, release p50 12.00 ms (3)" in scale._line(point)


def test_the_safety_counts_see_an_overlap_and_a_lost_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The counters a round reports as its safety are able to report a breach."""
    shared = Shared(multiprocessing.get_context("spawn"), slots=2)
    shared.critical(0, 0.0)
    assert (shared.total(), shared.overlaps.value) == (1, 0)
    # A second holder enters while the first is inside: an overlap. Both read the
    # counter before either wrote it back, so one increment is lost.
    entered, leave = threading.Semaphore(0), threading.Event()

    def hold(seconds: float) -> None:
        entered.release()
        assert leave.wait(30)

    monkeypatch.setattr(workers, "time", SimpleNamespace(sleep=hold))
    holders = [threading.Thread(target=shared.critical, args=(1, 1.0)) for _ in range(2)]
    for holder in holders:
        holder.start()
        assert entered.acquire(timeout=30)  # inside, its counter read
    leave.set()
    for holder in holders:
        holder.join(30)
        assert not holder.is_alive()
    assert shared.overlaps.value == 1
    assert shared.total() == 2  # three sections entered: one update lost
    shared.reset()
    assert (shared.total(), shared.overlaps.value) == (0, 0)


@pytest.mark.parametrize("kind", ["floor", "ours"])
def test_a_pool_round_counts_every_handoff_and_no_breach(
    mongolock_url: str, bench_database: None, kind: Kind
) -> None:
    spec = Spec(kind, kind, mongolock_url, collection=f"harness_{kind}", poll=0.01)
    pool = Pool(3)
    try:
        assert pool.run(Job("connect", spec, parties=3)).workers == [
            {"worker": 0},
            {"worker": 1},
            {"worker": 2},
        ]
        round_ = pool.run(Job("handoff", spec, parties=3, duration=1.0, hold=0.005))
    finally:
        pool.close()
    records = [record for worker in round_.workers for record in worker["records"]]
    assert len({worker["pid"] for worker in round_.workers}) == 3
    assert all(worker["records"] for worker in round_.workers)
    # Every critical section counted once, none entered twice at a time.
    assert round_.counted == len(records)
    assert round_.overlaps == 0
    # The sections, as timed by their workers, follow one another.
    sections = sorted((acquired, released) for _, acquired, released, _ in records)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(sections))
    assert not any(process.is_alive() for process in pool.processes)


def test_a_failed_round_is_reported_and_the_pool_still_stops(
    mongolock_url: str, bench_database: None
) -> None:
    """A worker's error names the worker and the workload; ``close`` then stops every
    worker in bounded time, including those that failed and those never asked."""
    spec = Spec("floor", "floor", mongolock_url, collection="harness_failed")
    pool = Pool(3)
    try:
        with pytest.raises(RuntimeError, match=r"worker \d failed in no-such-workload"):
            pool.run(Job("no-such-workload", spec, parties=2), timeout=60)
    finally:
        started = time.monotonic()
        pool.close()
        closed_in = time.monotonic() - started
    assert not any(process.is_alive() for process in pool.processes)
    assert closed_in < 60  # within close's own bound: nothing waited on a stuck queue


def _counting(contender: Any) -> list[float]:
    """Record when each try of ``contender`` begins."""
    tries: list[float] = []
    real = contender.try_acquire

    def try_acquire(key: str) -> object | None:
        tries.append(time.monotonic())
        handle: object | None = real(key)
        return handle

    contender.try_acquire = try_acquire
    return tries


def test_connecting_tries_again_until_the_server_answers(
    nowhere: socket.socket, bench_database: None, mongolock_url: str
) -> None:
    """A worker coming up while the server does not answer is not failed: its unmeasured
    first lock is tried again until it is taken, and given back."""
    port = nowhere.getsockname()[1]
    spec = Spec("floor", "floor", _url(port), collection="harness_connect")
    contender = build(spec)
    tries = _counting(contender)
    shared = Shared(multiprocessing.get_context("spawn"), slots=1)
    result: list[Any] = []
    [(host, server_port)] = uri_parser.parse_uri(mongolock_url)["nodelist"]
    try:
        thread = threading.Thread(
            target=lambda: result.append(
                workers._connect(contender, Job("connect", spec), None, shared, 7)
            ),
            daemon=True,  # not left trying for its whole bound if this test fails
        )
        thread.start()
        until(lambda: len(tries) >= 2, 30, "a second try")
        assert thread.is_alive()
        assert result == []
        # The server comes up on that port: a proxy to the test replica set's node.
        nowhere.close()
        with TcpProxy((host, server_port), port=port, name="bench-late"):
            thread.join(30)
            assert not thread.is_alive()
            contender.close()  # its connections end before the proxy's
    finally:
        contender.close()
    assert result == [{"worker": 7}]
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        assert client[DATABASE]["harness_connect"].find_one({"_id": "connect-7"}) is None
    finally:
        client.close()


def test_connecting_gives_up_after_its_bound(
    nowhere: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for a failed try (server selection gives up after 0.3 s) and the pause after it.
    monkeypatch.setattr(workers, "CONNECT_WITHIN", 3.0)
    spec = Spec("floor", "floor", _url(nowhere.getsockname()[1]), collection="harness_nowhere")
    contender = build(spec)
    tries = _counting(contender)
    shared = Shared(multiprocessing.get_context("spawn"), slots=1)
    started = time.monotonic()
    try:
        with pytest.raises(PyMongoError):
            workers._connect(contender, Job("connect", spec), None, shared, 0)
        gave_up = time.monotonic() - started
    finally:
        contender.close()
    # Tried again after the first failure, and given up only once the bound had passed.
    assert len(tries) >= 2
    assert gave_up >= workers.CONNECT_WITHIN


def test_the_refresh_pairs_take_turns_going_first_and_drop_the_warm_up(
    mongolock_url: str, bench_database: None
) -> None:
    """Tick and raw write alternate which runs first, every turn timed but the first, so
    that neither side always meets the server just after the other's write."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        collection = client[DATABASE]["harness_ticks"]
        keys = [f"tick-{n}" for n in range(3)]
        collection.insert_many([{"_id": key} for key in keys])
        calls: list[str] = []

        class Logged:
            def update_many(self, *arguments: Any, **options: Any) -> Any:
                calls.append("raw")
                return collection.update_many(*arguments, **options)

        ours, floor = _time_ticks(
            lambda: calls.append("tick"), cast("Collection[dict[str, Any]]", Logged()), keys, 4
        )
    finally:
        client.close()
    assert len(ours) == len(floor) == 4
    # The first turn warms up (not kept); then the order flips every turn.
    assert calls == ["raw", "tick"] + ["tick", "raw", "raw", "tick"] * 2


def test_the_line_cost_applies_each_write_as_it_would_change_a_running_line(
    mongolock_url: str, bench_database: None
) -> None:
    """Each write of the line-cost table does its real work on every document: the
    handoff makes the first waiter the holder and names the second the head, the renewal
    moves the last place on, the join adds a place; the plain write leaves the line."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    collection = client[DATABASE]["harness_line"]
    try:
        writes = line_cost._writes(5)
        line_cost._turn(collection, 3, 5, writes["handoff"])
        for doc in collection.find():
            assert (doc["owner"], head_owner(doc["head"])) == ("waiter-0", "waiter-1")
            assert doc["token"] > 5
        # Over places that last a minute, the handoff cuts every place behind its head
        # to the line check and the grace period from the handoff (its acquired_at).
        line_cost._turn(collection, 3, 5, writes["handoff, every place cut"])
        for doc in collection.find():
            assert doc["owner"] == "waiter-0"
            cut = doc["acquired_at"] + timedelta(seconds=7)
            assert [place["until"] for place in doc["waiters"][2:]] == [cut] * 3
        line_cost._turn(collection, 3, 5, writes["renewal"])
        for doc in collection.find():
            assert doc["waiters"][-1]["until"] > doc["waiters"][0]["until"]
        line_cost._turn(collection, 3, 5, writes["join"])
        for doc in collection.find():
            assert [place["owner"] for place in doc["waiters"]][-1] == "newcomer"
            assert len(doc["waiters"]) == 6
        line_cost._turn(collection, 3, 5, writes["plain"])
        for doc in collection.find():
            assert len(doc["waiters"]) == 5
            assert doc["owner"] == "holder"
    finally:
        client.close()
    data = line_cost.run(
        mongolock_url, (2, 8), documents=3, places_in_all=16, turns=1, name="harness_line_run"
    )
    table = line_cost.render(data)
    rows = [row.split(" | ")[:2] for row in table if row.startswith("| ") and row[2].isdigit()]
    assert rows == [["| 2", "8"], ["| 8", "3"]]
    assert list(data["points"]) == ["2", "8"]
    # The shorter line is written to more documents, down to the least asked for.
    assert [point.pop("documents") for point in data["points"].values()] == [8, 3]
    for point in data["points"].values():
        assert set(point) == {*line_cost.WRITES, "plain"}
        assert min(point.values()) > 0


def test_a_line_cost_turn_writes_its_lines_again_when_their_places_would_lapse_first(
    mongolock_url: str, bench_database: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn whose documents took so long to write that their places would lapse before
    its write writes them again, and measures over live places; a server that stays
    that slow stops the probe with an error saying so."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    collection = client[DATABASE]["harness_line_slow"]
    server_time = line_cost._server_time
    readings: list[datetime] = []

    def slow(
        late: Callable[[int], bool], took: float = 10
    ) -> Callable[[Collection[dict[str, Any]]], datetime]:
        """The server's time, read before and after each insert (the 2n-th reading comes
        after the n-th), as if the inserts ``late`` says took ``took`` seconds."""

        def read(on: Collection[dict[str, Any]]) -> datetime:
            readings.append(server_time(on))
            after = len(readings) % 2 == 0 and late(len(readings) // 2)
            return readings[-1] + timedelta(seconds=took if after else 0)

        return read

    try:
        monkeypatch.setattr(line_cost, "_server_time", slow(lambda insert: insert == 1))
        line_cost._turn(collection, 3, 5, line_cost._writes(5)["join"])
        assert len(readings) == 4  # written twice: the first insert was too slow
        # The documents measured are the second insert's.
        at = readings[2].replace(tzinfo=None)
        assert [doc["waiters"][0]["at"] for doc in collection.find()] == [at] * 3
        readings.clear()
        monkeypatch.setattr(line_cost, "_server_time", slow(lambda insert: True))
        with pytest.raises(RuntimeError, match="too slow for this probe"):
            line_cost._turn(collection, 3, 5, line_cost._writes(5)["join"])
        assert len(readings) == 2 * line_cost.TURN_TRIES
        # Places that last a minute leave ten seconds plenty of time; but a handoff cuts
        # them only while they last past the line check and the grace period, so 55 s
        # is too long for that write.
        cut = line_cost._writes(5)["handoff, every place cut"]
        for took, tries in ((10, 1), (55, 2)):
            readings.clear()
            monkeypatch.setattr(line_cost, "_server_time", slow(lambda insert: insert == 1, took))
            line_cost._turn(collection, 3, 5, cut)
            assert len(readings) == 2 * tries, took
    finally:
        client.close()


def test_the_line_cost_checks_refuse_a_renewal_or_join_over_a_lapsed_line(
    mongolock_url: str, bench_database: None
) -> None:
    """Over places that lapsed before the write, a renewal joins the end and a join meets
    no live place: whether the line is compacted (16 places) or not (4), the write's
    check finds no document as it should have left it."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    collection = client[DATABASE]["harness_line_lapsed"]
    try:
        for places in (4, 16):
            writes = line_cost._writes(places)
            for name in ("renewal", "join"):
                write = writes[name]
                collection.delete_many({})
                lapsed = line_cost._server_time(collection) - write.last - timedelta(seconds=1)
                collection.insert_many(
                    [line_cost._document(n, places, lapsed, write.last) for n in range(2)]
                )
                collection.update_many({}, write.pipeline, let=write.let)
                assert collection.count_documents(write.done) == 0, (places, name)
    finally:
        client.close()


def test_the_scale_table_counts_the_write_conflicts_the_server_ran_again(
    fail_points: MongoReplicaSet,
) -> None:
    """Write conflicts per write are the server's own count: two forced on one update
    count two, beside its one write command; the table gives them a column, "n/a" for
    a point recorded before they were counted."""
    client: MongoClient[dict[str, Any]] = MongoClient(fail_points.url)
    collection = client[DATABASE]["harness_conflicts"]
    try:
        collection.insert_one({"_id": "hot", "n": 0})
        before = scale.server_counters(client)
        client.admin.command("configureFailPoint", "WTWriteConflictException", mode={"times": 2})
        try:
            assert collection.update_one({"_id": "hot"}, {"$inc": {"n": 1}}).modified_count == 1
        finally:
            client.admin.command("configureFailPoint", "WTWriteConflictException", mode="off")
        ops = scale._ops(before, scale.server_counters(client))
    finally:
        collection.drop()
        client.close()
    # The counters are the whole server's, which nothing else writes to meanwhile.
    assert (ops["conflicts"], ops["writes"]) == (2, 1)
    point = {
        "waiters": 4,
        "wake": {"p50": 0.001, "p99": 0.002},
        "ops": ops,
        **scale._per_release(ops, 1),
        "cursors": 0,
    }
    assert point["conflicts_per_write"] == 2.0
    old = {key: value for key, value in point.items() if key != "conflicts_per_write"}
    data = {
        "hold": 0.005,
        "seconds": 3.0,
        "cores": 2,
        "keys": {"points": {"new": point, "old": old}},
    }
    lines = scale.render(data, None)
    header = next(line for line in lines if line.startswith("| shape |"))
    rows = [line for line in lines if line.startswith("| keys |")]
    column = header.split(" | ").index("write conflicts per write")
    assert [row.split(" | ")[column] for row in rows] == ["2.00", "n/a"]


def test_a_lock_call_that_times_out_is_counted_and_the_worker_goes_on(
    fail_points: MongoReplicaSet,
) -> None:
    """The server refuses the first write past its time limit (MaxTimeMSExpired, as a
    loaded server does): the acquire raises, the worker counts it and takes the key on
    its next try, rather than ending the run; the table and the targets say so."""
    spec = Spec("ours", "ours", fail_points.url, collection="harness_timeouts")
    admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.url)
    pool = Pool(1)
    try:
        pool.run(Job("connect", spec))
        # The reply's count is the server's since it started: each test counts from it.
        before = admin.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": 1},
            # Only the worker's client (by the library's app name) meets it.
            data={
                "failCommands": ["findAndModify"],  # an acquire's write, no other
                "errorCode": 50,
                "appName": "django-mongolock",
            },
        )["count"]
        done = pool.run(Job("handoff", spec, duration=0.5), timeout=60)
        fired = admin.admin.command("configureFailPoint", "failCommand", mode="off")["count"]
        assert fired - before == 1
    finally:
        pool.close()
        admin.admin.command("configureFailPoint", "failCommand", mode="off")
        admin[DATABASE]["harness_timeouts"].drop()
        admin.close()
    (result,) = done.workers
    assert result["timeouts"] == 1
    assert len(result["records"]) == done.counted > 0
    assert result["asked"] < result["records"][0][0]

    point = {
        "waiters": 4,
        "wake": {"p50": 0.001, "p99": 0.002},
        "ops": dict.fromkeys(scale.COUNTED, 0),
        **scale._per_release(dict.fromkeys(scale.COUNTED, 0), 1),
        "cursors": 0,
        "timeouts": result["timeouts"],
    }
    old = {key: value for key, value in point.items() if key != "timeouts"}
    data = {"hold": 0.005, "seconds": 3.0, "cores": 2, "processes": {"points": {"4": old}}}
    lines = scale.render({**data, "relay": {"points": {"4": point}}}, None)
    header = next(line for line in lines if line.startswith("| shape |"))
    column = header.split(" | ").index("calls timed out |")
    rows = [line for line in lines if line.startswith(("| processes |", "| relay |"))]
    cells = [row.split(" | ")[column] for row in rows]
    assert cells == ["n/a |", "1 |"]
    assert "1 calls timed out" in scale._line(point)

    # The same wake-ups meet the target without a timeout, and miss it with one at any
    # size; results recorded before they were counted name no such clause.
    def target(*timeouts: int | None) -> tuple[bool, bool]:
        points = {}
        for waiters, count in zip((4, 16, 200), timeouts, strict=True):
            points[str(waiters)] = {**old, "waiters": waiters}
            if count is not None:
                points[str(waiters)]["timeouts"] = count
        ((_, goal, _, _, met),) = scale.targets({"processes": {"points": points}})
        return goal.endswith("no call timed out"), met

    assert target(0, 0, 0) == (True, True)
    assert target(0, 1, 0) == (True, False)
    assert target(None, None, None) == (False, True)


def test_a_scale_target_names_python_redis_locks_ratio_at_the_same_counts() -> None:
    """The targets of processes on one key give python-redis-lock's ratio at the same two
    counts of the run beside ours; without it (or for the keys), nothing is added."""

    def point(waiters: int, p99: float, timeouts: int = 0) -> dict[str, Any]:
        return {"waiters": waiters, "wake": {"p50": p99 / 2, "p99": p99}, "timeouts": timeouts}

    ours = {"points": {"4": point(4, 0.004), "200": point(200, 0.012)}}
    redis = {"points": {"4": point(4, 0.001), "16": point(16, 0.0015), "200": point(200, 0.0025)}}
    for shape in ("processes", "relay"):
        ((_, _, figure, value, met),) = scale.targets({shape: ours, "redis": redis})
        assert figure == "12.0 ms vs 4.0 ms; python-redis-lock 2.50 ms vs 1.00 ms (2.50x)"
        assert (value, met) == (3.0, False)
    # Left out where its p99 leaves a timed-out call out, says nothing (no wake-up), or
    # was not timed at that count; the verdict is ours alone either way.
    for other in (point(200, 0.0025, timeouts=1), point(200, math.nan), None):
        redis["points"].pop("200", None)
        if other is not None:
            redis["points"]["200"] = other
        ((_, _, figure, value, met),) = scale.targets({"processes": ours, "redis": redis})
        assert figure == "12.0 ms vs 4.0 ms"
        assert (value, met) == (3.0, False)
    # The keys shape has no counterpart among the other lock's processes.
    redis["points"]["500"] = point(500, 0.0025)
    keys = {"points": {"4": point(4, 0.004), "500": point(500, 0.006)}}
    ((_, _, figure, _, met),) = scale.targets({"keys": keys, "redis": redis})
    assert figure == "6.0 ms vs 4.0 ms"
    assert met


def test_only_a_call_past_its_time_limit_counts_as_timed_out() -> None:
    """A server that did not answer in time is counted and the run goes on; a server
    that cannot be reached, or any other error, ends it."""

    def unavailable(cause: Exception) -> ServerUnavailable:
        try:
            raise ServerUnavailable(["127.0.0.1:1"], 5.0, str(cause)) from cause
        except ServerUnavailable as error:
            return error

    late = ExecutionTimeout("operation exceeded time limit")
    # The driver says a server it could not select timed out too: it is down, not late.
    down = [AutoReconnect("refused"), ServerSelectionTimeoutError("no server")]
    assert OurLock.timed_out(unavailable(late))
    assert not any(OurLock.timed_out(unavailable(error)) for error in down)
    assert not OurLock.timed_out(LockNotAcquired("busy"))
    assert FloorLock.timed_out(late)
    assert not any(FloorLock.timed_out(error) for error in down)


def test_paced_requests_wait_the_pause_after_the_previous_one_and_time_only_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each call is made ``pause`` after the previous call and its untimed ``then`` were
    done (the first after a pause too), and only the call itself is timed: what a release
    after a hold meets. On a clock of the test's own, so that the times are exact."""
    now = [100.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    clock = SimpleNamespace(perf_counter=lambda: now[0], sleep=sleep)
    monkeypatch.setattr(handoff_parts, "time", clock)
    log: list[tuple[str, int, float]] = []

    def send(n: int) -> int:
        log.append(("send", n, now[0]))
        sleep(0.002)
        return n * 10

    def then(answer: int) -> None:
        log.append(("then", answer, now[0]))
        sleep(0.02)

    times = handoff_parts.paced(send, 4, 0.03, then)
    assert [(kind, n) for kind, n, _ in log] == [
        (kind, n * 10 if kind == "then" else n) for n in range(4) for kind in ("send", "then")
    ]
    sends = [at for kind, _, at in log if kind == "send"]
    assert sends == pytest.approx([100.03 + n * 0.052 for n in range(4)])
    assert times == pytest.approx([0.002] * 4)


@pytest.mark.parametrize("stream", [False, True])
def test_the_lone_requests_are_timed_in_every_kind_and_leave_no_lock_held(
    mongolock_url: str, mongolock_database: str, stream: bool
) -> None:
    """Raw updates and uncontended acquires, back to back and paced: ``count`` of each,
    and each lock released again (closing the manager would not release it); with a
    change stream open, the rows say so."""
    times = handoff_parts.lone(
        mongolock_url, 7, database=mongolock_database, block=3, stream=stream
    )
    suffix = ", a change stream open" if stream else ""
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        locks = client[mongolock_database]["locks"]
        held = locks.count_documents({"owner": {"$nin": [None, ""]}})
        keys = sorted(locks.distinct("_id"))
    finally:
        client.close()
    assert set(times) == {
        name + suffix
        for name in (
            "raw: majority update, back to back",
            "raw: majority update, 5 ms after the previous request",
            "ours: acquire(), back to back",
            "ours: acquire(), 5 ms after the previous request",
        )
    }
    assert [len(values) for values in times.values()] == [7] * 4
    assert keys == [f"lone-{n}" for n in range(handoff_parts.LONE_KEYS)]
    assert held == 0


def _change_streams(url: str, database: str) -> set[int]:
    """The cursor ids of the change streams open on ``database`` (each counted once,
    whether its getMore runs or it sits idle between two)."""
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    try:
        ops = client.admin.aggregate(
            [
                {"$currentOp": {"idleCursors": True, "allUsers": True}},
                {
                    "$match": {
                        "cursor.originatingCommand.pipeline.0.$changeStream": {"$exists": True},
                        "cursor.originatingCommand.$db": database,
                    }
                },
            ]
        )
        return {op["cursor"]["cursorId"] for op in ops}
    finally:
        client.close()


def test_a_probe_table_has_a_row_of_milliseconds_per_name_under_its_header() -> None:
    times = {"a": [0.001, 0.002, 0.003], "b": [0.0005]}
    assert table("write", times).splitlines() == [
        "| write | p50 | p90 | n |",
        "|---|---|---|---|",
        "| a | 2.000 ms | 2.800 ms | 3 |",
        "| b | 0.500 ms | 0.500 ms | 1 |",
    ]


def _streams_closed(url: str, database: str) -> None:
    """Wait (bounded) until no change stream is open on ``database``."""
    until(lambda: not _change_streams(url, database), timeout=10, what="the streams closed")


def test_the_streams_held_open_are_open_while_the_block_runs(
    mongolock_url: str, mongolock_database: str
) -> None:
    """``held_open``: the streams, in another process, open when the block starts (each
    waiting in its getMore a second by then); closed once it ended."""
    with held_open(mongolock_url, 2, database=mongolock_database, collection="locks"):
        assert len(_change_streams(mongolock_url, mongolock_database)) == 2
    _streams_closed(mongolock_url, mongolock_database)


def test_a_block_whose_held_stream_closed_is_an_error(
    mongolock_url: str, mongolock_database: str
) -> None:
    """Dropping the watched collection ends its stream (the server invalidates it): the
    block's figures would not be what they are named, so leaving it raises."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)

    def drop_while_held() -> None:
        with held_open(mongolock_url, 1, database=mongolock_database, collection="locks"):
            client[mongolock_database].drop_collection("locks")
            _streams_closed(mongolock_url, mongolock_database)
            time.sleep(2)  # its process notes it as soon as its getMore returned

    try:
        client[mongolock_database]["locks"].insert_one({"_id": "there"})
        with pytest.raises(RuntimeError, match="closed before the block ended"):
            drop_while_held()
    finally:
        client.close()


def test_the_copy_of_a_lock_renews_its_lease_and_its_places_and_keeps_the_rest() -> None:
    now = datetime(2026, 1, 2, tzinfo=UTC)
    lock: dict[str, Any] = {
        "_id": "k",
        "owner": "a",
        "token": 7,
        "expires_at": now,
        "waiters": [{"owner": "b", "until": now, "hand": True}, {"owner": "c", "until": None}],
        "ended": ["z"],
    }
    copy = handing_write.copy_of(lock, now)
    assert copy == {
        **lock,
        "_id": handing_write.COPY,
        "expires_at": now + handing_write.LEASE_LEFT,
        "waiters": [
            {"owner": "b", "until": now + handing_write.PLACE_LEFT, "hand": True},
            {"owner": "c", "until": now + handing_write.PLACE_LEFT},
        ],
    }
    assert lock["_id"] == "k"  # the lock itself is left as it was
    assert lock["waiters"][0]["until"] == now
    # Past the cut of a handoff: the handing release the probe times cuts them.
    assert handing_write.PLACE_LEFT > handing_write.CUT


def _changed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The paths whose values differ: top-level fields, and each place by its index
    (with the fields of it that changed)."""
    paths = {
        key
        for key in before.keys() | after.keys()
        if key != "waiters" and before.get(key, KeyError) != after.get(key, KeyError)
    }
    for index, (was, now) in enumerate(zip(before["waiters"], after["waiters"], strict=True)):
        paths |= {
            f"waiters.{index}.{key}"
            for key in was.keys() | now.keys()
            if was.get(key, KeyError) != now.get(key, KeyError)
        }
    return paths


def test_the_same_fields_write_changes_what_the_handing_release_changes(
    mongolock_url: str, mongolock_database: str
) -> None:
    """Applied to the same copy of a lock with a line, the literal write and the handing
    release change the same fields and the same places' fields: they differ only in
    how the server gets the values."""
    lock = handing_write._line(mongolock_url, mongolock_database, 4)
    commands = handing_write._commands(lock)
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        db = client[mongolock_database]
        changed = {}
        for kind in ("handing", "same fields"):
            copy = handing_write.copy_of(lock, datetime.now(UTC))
            db["locks"].replace_one({"_id": handing_write.COPY}, copy, upsert=True)
            before = db["locks"].find_one({"_id": handing_write.COPY})
            assert db.command(commands[kind])["nModified"] == 1
            after = db["locks"].find_one({"_id": handing_write.COPY})
            assert before is not None
            assert after is not None
            changed[kind] = _changed(before, after)
    finally:
        client.close()
    assert changed["handing"] == changed["same fields"]
    assert {"owner", "token", "head", "ended", "waiters.0.owner", "waiters.3.until"} <= changed[
        "handing"
    ]


def test_the_handing_write_probe_times_every_kind_and_drops_its_database(
    mongolock_url: str, mongolock_database: str
) -> None:
    """Every kind with both write concerns, ``writes`` times each (the probe itself checks
    that each handing release handed the lock on and each write for no document changed
    nothing); the database is gone afterwards."""
    times = handing_write.measure(mongolock_url, 3, places=2, database=mongolock_database, block=2)
    assert set(times) == {
        f"{kind}, {concern}" for kind in handing_write.KINDS for concern in handing_write.CONCERNS
    }
    assert all(len(values) == 3 for values in times.values())
    assert all(0 < took < handing_write.BOUND for values in times.values() for took in values)
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        assert mongolock_database not in client.list_database_names()
    finally:
        client.close()


@pytest.mark.parametrize(
    ("kind", "query"),
    [
        ("handing", {"owner": "somebody else"}),  # changes nothing
        ("handing, no document", {"_id": handing_write.COPY}),  # finds the copy
    ],
)
def test_the_handing_write_probe_refuses_a_write_that_does_not_do_what_it_is_named(
    mongolock_url: str,
    mongolock_database: str,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    query: dict[str, Any],
) -> None:
    """A handing release that hands nothing on, or a write for no document that finds
    one, is not timed as what it is named: the probe stops with an error naming the kind,
    its stream closed and its database dropped."""
    commands = handing_write._commands

    def altered(lock: dict[str, Any]) -> dict[str, dict[str, Any]]:
        made = commands(lock)
        made[kind]["updates"][0]["q"].update(query)
        return made

    monkeypatch.setattr(handing_write, "_commands", altered)
    with pytest.raises(RuntimeError, match=f"'{kind}' did not do what it is timed for"):
        handing_write.measure(mongolock_url, 2, places=2, database=mongolock_database, block=1)
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        assert mongolock_database not in client.list_database_names()
    finally:
        client.close()
    _streams_closed(mongolock_url, mongolock_database)


def test_the_tick_probe_times_the_lanes_ticks_with_each_write_encoded_and_none_sent(
    mongolock_url: str, mongolock_database: str
) -> None:
    """``tick_cpu``: every timed tick encodes the exclusive and the shared write, sends no
    command, extends every lease as reported, and leaves the store as it found it."""
    manager = RecordedManager(mongolock_url, database=mongolock_database, ttl=300)
    recorder = manager.recorder = Recorder()  # read when the first client is built
    try:
        held = tick_cpu.take(manager, 70, 2)  # enough for the store to keep its write
        store = manager.store
        collection = store.collection
        recorder.clear()
        deadlines = [lock.deadline for lock in held]
        encoded: list[int] = []
        with tick_cpu.answering_at_once(manager) as sizes:
            lane = get_refresher().lane_of(manager)
            assert lane is not None
            lane.tick()
            encoded = list(sizes)
        assert len(encoded) == 2
        assert min(encoded) > 0
        built: list[int] = []
        build = lanes._Batch.of

        def counted(locks: Any, version: int) -> lanes._Batch:
            built.append(len(locks))
            return build(locks, version)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lanes._Batch, "of", counted)
            spent = tick_cpu.measure(manager, 3)
            assert built == []  # the leases did not change: listed once, before
            assert recorder.on(mongolock_database, manager.collection) == []  # nothing sent
            churned = tick_cpu.measure(manager, 3, churn=True)
            assert built == [72] * 4  # a lock came and went before each tick
        # Only that lock's acquires and releases went to the server, no refresh write.
        sent = recorder.on(mongolock_database, manager.collection)
        assert len(sent) >= 8
        assert not [
            update
            for command in sent
            if command.name == "update"
            for update in command.command["updates"]
            if update.get("multi")
        ]
        assert len(spent) == len(churned) == 3
        assert min(spent + churned) > 0
        assert all(lock.valid for lock in held)
        # Each tick told every lease it was extended: the deadlines moved on.
        assert all(lock.deadline > before for lock, before in zip(held, deadlines, strict=True))
        assert store.collection is collection
        assert "heartbeat" not in vars(store)
        for lock in held:
            assert lock.release()
    finally:
        manager.close()


def test_handoffs_between_several_processes_are_split_into_their_steps(
    mongolock_url: str, mongolock_database: str
) -> None:
    """Three real processes take turns: nearly every turn after the warm-up is handed
    over by a release of another process, and is paired with it: its event came after
    that release was sent, and the next holder returned after it."""
    turns = handoff_parts.WARM_UP + 10
    parts = handoff_parts.ours(mongolock_url, turns, processes=3, database=mongolock_database)
    # One process's request after its release may find the key free and take it itself.
    assert 3 * 10 // 2 <= len(parts["gap"]) <= 3 * 10
    for release, event, wake, gap in zip(*parts.values(), strict=True):
        assert release + event > 0
        assert wake >= 0
        assert 0 < gap < handoff_parts.BOUND


def test_the_raw_limit_of_a_handoff_is_each_update_sent_until_its_event_heard(
    mongolock_url: str, mongolock_database: str
) -> None:
    """One majority update after each pause, and its change event in another process:
    every update after the warm-up is heard, and its limit is its round trip plus how
    long after its reply the event came (which may be before it)."""
    writes, pause = 8, 0.1
    started = time.monotonic()
    parts = handoff_parts.raw(
        mongolock_url, handoff_parts.WARM_UP + writes, mongolock_database, pause=pause
    )
    assert time.monotonic() - started >= (handoff_parts.WARM_UP + writes) * pause
    assert [len(values) for values in parts.values()] == [writes] * 3
    for write, event, limit in zip(parts["write"], parts["event"], parts["limit"], strict=True):
        assert 0 < write < handoff_parts.BOUND
        assert limit == pytest.approx(write + event)
        assert 0 < limit < handoff_parts.BOUND


def _handoff_rows(limit: list[float]) -> dict[str, Any]:
    """The handoff section's data: a row of ours (its gaps, one acquire, the limit) and
    the polling floor's, which times neither of the last two."""
    ours = {
        "rate": {"median": 100.0},
        "wait": summary([0.01, 0.02]),
        "gap": summary([0.002, 0.003]),
        "cross_gap": summary([0.002]),
        "alone": summary([0.001]),
        "limit": summary(limit),
        "limit_write": summary([value + 0.0001 for value in limit]),
        "other_share": 1.0,
        "fewest_share": 1.0,
        "timeouts": 0,
        "overlaps": 0,
        "lost": 0,
    }
    floor = {**ours, "alone": summary([]), "limit": summary([]), "limit_write": summary([])}
    return {
        "floor": FLOOR_POLL_10,
        "processes": 4,
        "hold": 0.005,
        "seconds": 5.0,
        "rounds": 3,
        "rows": {OURS: ours, FLOOR_POLL_10: floor},
    }


def test_the_handoff_gap_is_reported_beside_its_limit_when_the_run_timed_it() -> None:
    """The target row and the section give the limit timed in the same rounds, and the
    gap over it; a run without it (an older result) says nothing of it."""
    data = _handoff_rows([0.0012, 0.0012, 0.0014])
    (gap_row,) = [row for row in targets({"handoff": data}) if "gap p50" in row["target"]]
    assert gap_row["figure"] == "2.50 ms; one acquire 1.00 ms; the limit 1.20 ms (the gap 2.08x it)"
    assert gap_row["ratio"] == pytest.approx(2.5)
    assert gap_row["met"] is False
    text = "\n".join(sections.handoff(data, None))
    assert "5 ms after the previous one returned" in text
    assert "p50 1.20 ms, p99 1.40 ms (the same updates' round trips: p50 1.30 ms;" in text
    untimed = _handoff_rows([])
    older = _handoff_rows([])
    del older["rows"][OURS]["limit"], older["rows"][OURS]["limit_write"]
    for data in (untimed, older):
        (gap_row,) = [row for row in targets({"handoff": data}) if "gap p50" in row["target"]]
        assert gap_row["figure"] == "2.50 ms; one acquire 1.00 ms"
        assert "server's limit" not in "\n".join(sections.handoff(data, None))


def test_the_think_time_probe_times_every_write_of_each_kind_after_its_warm_up(
    mongolock_url: str,
) -> None:
    """One block of each kind: its two writes a cycle as the listener saw them (no other
    command counted), and the time from each reply to the next write; the run's
    collections are dropped."""
    cycles = think_time.BLOCK - think_time.WARM_UP
    trips, waits = think_time.measure(mongolock_url, cycles, thinks=(0, 100, 100))
    names = ["floor, 0 µs before each write", "floor, 100 µs before each write", think_time.OURS]
    assert list(trips) == list(waits) == names
    assert [len(values) for values in trips.values()] == [2 * cycles] * 3
    assert [len(values) for values in waits.values()] == [2 * cycles] * 3
    assert all(0 < value < 10 for values in trips.values() for value in values)
    # Spun 100 µs before each write, the floor waited at least that long between two.
    assert min(waits["floor, 100 µs before each write"]) >= 100e-6
    assert all(0 < value < 10 for values in waits.values() for value in values)
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        names = client[DATABASE].list_collection_names()
    finally:
        client.close()
    assert not [name for name in names if name.startswith(think_time.COLLECTION)]


def test_the_think_time_listener_counts_the_writes_of_its_own_thread_alone() -> None:
    """A write's round trip and the wait before the next write, in the thread that made
    the listener; a read, a write of another thread (a refresher's tick), a write after
    ``pause`` (another kind's turn) and one after a failed write add no wait, and the
    first two no round trip."""
    replies = think_time.Replies()

    def event(name: str) -> Any:
        return SimpleNamespace(command_name=name, duration_micros=1500)

    replies.succeeded(event("findAndModify"))
    replies.started(event("find"))
    replies.succeeded(event("find"))

    def write_elsewhere() -> None:
        replies.started(event("update"))
        replies.succeeded(event("update"))
        replies.failed(event("update"))

    other = threading.Thread(target=write_elsewhere)
    other.start()
    other.join(10)
    replies.started(event("update"))
    replies.succeeded(event("update"))
    replies.pause()
    replies.started(event("delete"))
    replies.failed(event("delete"))
    replies.started(event("delete"))
    assert replies.trips == [0.0015, 0.0015]
    assert len(replies.waits) == 1
    assert 0 <= replies.waits[0] < 1


def test_spinning_keeps_the_thread_busy_for_the_time_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Busy, not asleep: the probe's spin must be code running, as the lock's is."""

    # The probe's clock alone, with no sleep to call (patching ``time.sleep`` itself
    # would break the other threads of the session that sleep meanwhile).
    monkeypatch.setattr(client_cpu, "time", SimpleNamespace(perf_counter=time.perf_counter))
    started, cpu = time.perf_counter(), time.thread_time()
    client_cpu.spin(0.02)
    assert time.perf_counter() - started >= 0.02
    assert time.thread_time() > cpu


def test_each_handoff_is_paired_with_the_release_that_made_it() -> None:
    """By the releasing holder's id, across processes; a turn taken by an attempt of its
    own, one from a release nobody reported, and the warm-up turns are left out."""
    warm = handoff_parts.WARM_UP
    # (heard, returned, previous) turns and (owner, sent, done) releases per process.
    a_turns: list[Any] = [(1.0, 1.1, "b0")] * warm + [(10.0, 10.2, "b1"), (40.0, 40.5, "c9")]
    b_turns: list[Any] = [(2.0, 2.1, "a0")] * warm + [(None, 5.0, ""), (21.1, 21.3, "a1")]
    results: list[tuple[list[Any], list[Any]]] = [
        (a_turns, [("a0", 0.5, 0.9), ("a1", 20.0, 21.0)]),
        (b_turns, [("b0", 0.4, 0.8), ("b1", 9.0, 9.9)]),
    ]
    parts = handoff_parts.pair(results)
    assert parts["release"] == pytest.approx([0.9, 1.0])
    assert parts["event"] == pytest.approx([0.1, 0.1])
    assert parts["wake"] == pytest.approx([0.2, 0.2])
    assert parts["gap"] == pytest.approx([1.2, 1.3])


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize(("kind", "line", "own"), [("read", 0, 0), ("own", 0, 3), ("same", 3, 0)])
def test_a_burst_of_processes_sends_its_requests_while_the_lock_is_written(
    mongolock_url: str, mongolock_database: str, kind: str, line: int, own: int
) -> None:
    """Three real processes send one request each, of the kind asked: places on the lock's
    line, on documents of their own, or nothing written; every write of the writer is
    timed once, before, during or after the burst."""
    run = arrival_load.burst(mongolock_url, kind, 3, database=mongolock_database)
    assert (run["line"], run["own"]) == (line, own)
    assert len(run["requests"]) == 3
    assert all(0 < took < arrival_load.BOUND for took in run["requests"])
    assert 0 <= run["burst"] < arrival_load.BOUND
    assert run["before"]
    assert run["after"]
    assert len(run["before"]) + len(run["during"]) + len(run["after"]) == run["writes"]
    assert arrival_load.row(run).startswith(f"| {arrival_load.KINDS[kind]} | ")


def test_the_writes_are_split_around_the_burst_by_when_they_were_sent() -> None:
    """Sent at the release: during; at the last answer: during; after it: after."""
    writes = [(0.5, 0.001), (1.0, 0.002), (1.5, 0.003), (2.0, 0.004), (2.5, 0.005)]
    assert arrival_load.split(writes, 1.0, 2.0) == ([0.001], [0.002, 0.003, 0.004], [0.005])


def test_a_burst_of_an_unknown_kind_or_no_process_is_refused_before_any_starts() -> None:
    with pytest.raises(ValueError, match="kind must be one of read, own, same; got 'write'"):
        arrival_load.burst("mongodb://127.0.0.1:1", "write", 3)
    with pytest.raises(ValueError, match="processes must be at least 1; got 0"):
        arrival_load.burst("mongodb://127.0.0.1:1", "read", 0)


def test_the_report_names_the_servers_cache_and_oplog() -> None:
    """The run's server, described with the sizes that shape a write's cost (eviction),
    and the report's row for them, left out of the reports of older runs."""
    with MongoReplicaSet(name="described", cache_size_gb=0.5, oplog_size_mb=300) as sized:
        server = servers._describe(sized.url, started_here=False)
    assert server.storage == "WiredTiger cache 512 MiB, oplog 300 MiB"
    assert [servers.size(n) for n in (2**30 - 2**20, 2**30, 11.27 * 2**30)] == [
        "1023 MiB",
        "1.00 GiB",
        "11.27 GiB",
    ]
    meta = {
        "load_start": [0.1, 0.2, 0.3],
        "started": "2026-12-05T06:00:00+00:00",
        "command": "python benchmarks/run.py",
        "mode": "full",
        "django_mongolock": "0.1.0",
        "commit": "abc1234",
        "pymongo": "4.20.1",
        "python": "3.11.7",
        "django": "5.2",
        "platform": "Linux",
        "usable_cores": 2,
        "cores": 2,
    }
    row = f"| MongoDB storage | {server.storage} |"
    assert row in report._header({**meta, "mongodb_storage": server.storage})
    assert not any("MongoDB storage" in line for line in report._header(meta))
