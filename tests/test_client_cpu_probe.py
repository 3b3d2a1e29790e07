"""The client CPU probe (``benchmarks.client_cpu``): its reference without the operation
limit really sends no limit and puts it back, and each mode measures what it names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from benchmarks import client_cpu
from benchmarks.contenders import DATABASE, Spec, build
from django_mongolock import LockManager, mongo
from django_mongolock.signals import lock_acquired
from django_mongolock.store.holder import HolderQueries
from tests.commands import Recorder


@pytest.fixture
def probe_collections(mongolock_url: str) -> Iterator[None]:
    """The probe writes to its own collections (``client-cpu...``): dropped after."""
    yield
    client_cpu.drop_collections(mongolock_url)


@pytest.fixture
def recorded(mongolock_url: str, probe_collections: None) -> Iterator[tuple[LockManager, Recorder]]:
    """A manager on the probe's collection whose client records every command it sends."""
    commands = Recorder()
    client: MongoClient[dict[str, Any]] = MongoClient(
        mongolock_url, timeoutMS=5000, event_listeners=[commands]
    )
    manager = LockManager(client=client, database=DATABASE, collection=client_cpu.COLLECTION)
    yield manager, commands
    manager.close()
    client.close()


def test_the_reference_without_a_limit_sends_none_and_puts_the_limit_back(
    recorded: tuple[LockManager, Recorder],
) -> None:
    manager, commands = recorded
    original = mongo.operation_limit
    manager.acquire("limited", blocking=False).release()
    with client_cpu.lifted():
        manager.acquire("lifted", blocking=False).release()
    with pytest.raises(RuntimeError), client_cpu.lifted():
        raise RuntimeError("a cycle that failed")
    manager.acquire("limited again", blocking=False).release()
    assert mongo.operation_limit is original
    sent = [s.command for s in commands.on(DATABASE, client_cpu.COLLECTION)]
    assert len(sent) == 6  # an acquire and a release each time
    limited, lifted, again = sent[:2], sent[2:4], sent[4:]
    assert all("maxTimeMS" in command for command in limited + again)
    assert not any("maxTimeMS" in command for command in lifted)


def test_each_way_runs_the_layers_it_names(
    mongolock_url: str, probe_collections: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole-call ways announce their locks, the store's do not; the limited ways
    write under the operation limit, the others under none; the floor never reaches
    our store."""
    seen: list[tuple[str, float]] = []
    way = ""
    send = HolderQueries._send

    def sent(self: HolderQueries, command: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        seen.append((way, self.timeout))  # the limit the store puts on its write
        return send(self, command)

    def acquired(sender: object, **named: Any) -> None:
        seen.append((way, -1.0))

    monkeypatch.setattr(HolderQueries, "_send", sent)
    lock_acquired.connect(acquired, weak=False)
    try:
        with client_cpu._ways(mongolock_url) as ways:
            for way in client_cpu.WAYS:  # read by the two receivers above
                ways[way](f"way-{way}")
    finally:
        lock_acquired.disconnect(acquired)
    by_way = {name: [limit for w, limit in seen if w == name] for name in client_cpu.WAYS}
    assert by_way["floor"] == []
    for name in ("ours", "unlimited"):
        assert -1.0 in by_way[name], name  # lock_acquired: the whole call
    for name in ("store", "store-unlimited"):
        assert -1.0 not in by_way[name], name
    for name in ("ours", "store"):
        limits = [t for t in by_way[name] if t != -1.0]
        assert len(limits) == 2, name
        assert all(limit > 0 for limit in limits), name
    for name in ("unlimited", "store-unlimited"):
        assert [t for t in by_way[name] if t != -1.0] == [0.0, 0.0], name


def test_a_refused_cycle_stops_the_probe(mongolock_url: str, probe_collections: None) -> None:
    with (
        LockManager(mongolock_url, database=DATABASE, collection=client_cpu.COLLECTION) as other,
        other.acquire("held elsewhere"),
        client_cpu._ways(mongolock_url) as ways,
    ):
        for way in ("ours", "store"):
            with pytest.raises(RuntimeError, match="was refused"):
                ways[way]("held elsewhere")
        floor = build(
            Spec("floor", "floor", mongolock_url, collection=f"{client_cpu.COLLECTION}-floor")
        )
        try:
            assert floor.try_acquire("held by a floor lock") is not None
            with pytest.raises(RuntimeError, match="floor: 'held by a floor lock' was refused"):
                ways["floor"]("held by a floor lock")
        finally:
            floor.close()


def test_each_way_is_measured_in_every_block(mongolock_url: str, probe_collections: None) -> None:
    usage = client_cpu.measure(mongolock_url, blocks=2, cycles=5)
    assert set(usage) == set(client_cpu.WAYS)
    for blocks in usage.values():
        assert len(blocks) == 2
        # Each cycle waits for its two replies at least: the thread sleeps, and runs.
        assert all(block.switches >= 1 and block.cpu > 0 for block in blocks)


def test_the_report_takes_each_way_above_the_floor_block_by_block() -> None:
    def blocks(*cpus: float) -> list[client_cpu.Usage]:
        return [client_cpu.Usage(cpu, 2.0) for cpu in cpus]

    usage = {way: blocks(1000.0, 1100.0, 1300.0) for way in client_cpu.WAYS}
    usage["ours"] = blocks(1300.0, 1350.0, 1500.0)  # 300, 250 and 200 above
    table = client_cpu.report(usage)
    assert table[2] == (
        "| ours | 1,350 (1,300 to 1,500) | 250 (200 to 300) | 2.00 (2.00 to 2.00) |"
    )
    assert table[4].startswith("| store alone | 1,100 (1,000 to 1,300) | 0 (0 to 0) |")
    assert table[6] == "| floor | 1,100 (1,000 to 1,300) |  | 2.00 (2.00 to 2.00) |"
    assert table[7:] == [""]


def test_the_many_keys_shape_counts_clients_and_server(
    mongolock_url: str, probe_collections: None
) -> None:
    client: MongoClient[dict[str, Any]]
    with MongoClient(mongolock_url) as client:
        pid = int(client.admin.command("serverStatus")["pid"])
    comm = Path(f"/proc/{pid}/comm")
    if not comm.exists() or comm.read_text().strip() != "mongod":
        pytest.skip("the test server is no mongod of this host: its CPU is unseen")
    rows = client_cpu.processes(mongolock_url, count=2, rounds=1, seconds=1.0)
    assert set(rows) == {"floor", "floor + TTL index", "ours"}
    for label, rounds in rows.items():
        assert len(rounds) == 1
        assert all(r.rate > 0 and r.client > 0 and r.server > 0 for r in rounds), label
    table = client_cpu.processes_report(rows)
    assert table[-2].startswith("| ours above the floor + TTL index (by round) | ")
    rate = table[-2].split(" | ")[1]  # ours' rate over the floor's, as a ratio
    assert rate.endswith("x)")
    assert float(rate.split("x")[0]) > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--only", "nobody"],
        ["--only"],
        ["0"],
        ["12", "500", "3"],
        ["many"],
        ["--processes", "4", "6", "3", "1"],
        ["--only", "ours", "1", "2"],
        ["--replayed", "6", "2000", "1"],
        ["--replayed", "none"],
    ],
)
def test_bad_arguments_are_refused_by_name(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match=r"--only|expected"):
        client_cpu._arguments(argv)


def test_good_arguments_choose_the_mode() -> None:
    assert client_cpu._arguments([]) == ("", [])
    assert client_cpu._arguments(["3", "100"]) == ("", [3, 100])
    assert client_cpu._arguments(["--only", "store", "50"]) == ("store", [50])
    assert client_cpu._arguments(["--processes", "2"]) == ("--processes", [2])
    assert client_cpu._arguments(["--replayed"]) == ("--replayed", [])
    assert client_cpu._arguments(["--replayed", "2", "10"]) == ("--replayed", [2, 10])


def test_a_replayed_store_sends_nothing_and_gives_its_methods_back(
    recorded: tuple[LockManager, Recorder],
) -> None:
    manager, commands = recorded
    store = manager.store
    with client_cpu.replayed(manager):
        sent = len(commands.on(DATABASE, client_cpu.COLLECTION))
        assert sent == 2  # the reply it replays: one acquire and its release
        before = len(commands.sent)
        for _ in range(3):
            client_cpu.replayed_cycle(manager)  # the measured cycle, as measured
        assert commands.sent[before:] == []  # on any collection
    with pytest.raises(RuntimeError), client_cpu.replayed(manager):
        raise RuntimeError("a measure that failed")
    assert "acquire" not in vars(store)
    assert "release" not in vars(store)
    lock = manager.acquire("real", blocking=False, refresh=False)
    found = store.find("real")  # the server has it
    assert found is not None
    assert found.owner == lock.owner
    assert lock.release() is True
    assert len(commands.on(DATABASE, client_cpu.COLLECTION)) > sent


def test_the_replayed_mode_measures_each_order_block_by_block(
    mongolock_url: str, probe_collections: None
) -> None:
    medians = client_cpu.measure_replayed(mongolock_url, blocks=2, cycles=20)
    assert set(medians) == set(client_cpu.ORDERS)
    assert all(len(blocks) == 2 and min(blocks) > 0 for blocks in medians.values())
    table = client_cpu.replayed_report(medians)
    assert [row.split(" | ")[0] for row in table[2:5]] == [f"| {o}" for o in client_cpu.ORDERS]
