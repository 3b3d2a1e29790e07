"""The write-modes probe: its modes, and its run on a server of its own that it leaves
nothing of. A probe that found modes where there are none, or left a server running,
would mislead whoever reads its table."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pymongo.collection import Collection

from benchmarks import handoff_parts, write_modes
from django_mongolock.testing import MongoReplicaSet


def _at(ms: float, count: int) -> list[float]:
    """``count`` round trips of ``ms`` milliseconds (in the middle of their bin)."""
    return [(ms + 0.05) / 1000] * count


def test_the_modes_are_the_bins_that_stand_above_their_neighbours() -> None:
    # Two peaks 1 ms apart, each with lower bins beside it.
    samples = _at(0.9, 50) + _at(1.0, 400) + _at(1.1, 80) + _at(1.9, 60) + _at(2.0, 90)
    samples += _at(2.1, 30)
    assert [round(m * 1000, 2) for m in write_modes.modes(samples)] == [1.05, 2.05]
    # A bin below its share is no mode, however it stands among its neighbours.
    few = _at(1.0, 990) + _at(3.0, 10)
    assert [round(m * 1000, 2) for m in write_modes.modes(few)] == [1.05]
    # A higher bin within the span hides a lower one; of two equal neighbours, the
    # lower is the mode.
    near = _at(1.0, 300) + _at(1.2, 400) + _at(2.0, 200) + _at(2.1, 200)
    assert [round(m * 1000, 2) for m in write_modes.modes(near)] == [1.25, 2.05]
    # Beyond the span, it does not.
    apart = _at(1.0, 300) + _at(1.0 + (write_modes.MODE_SPAN + 1) / 10, 400)
    assert len(write_modes.modes(apart)) == 2
    assert write_modes.modes([]) == []


def test_the_probe_times_each_kind_on_a_server_of_its_own_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writes of each concern and pause after the warm-up, on a server started with
    the options asked for, whose data is under the directory given; both gone after."""
    seen: dict[str, Any] = {}
    timed = write_modes._timed
    started = _started_sets(monkeypatch)

    def noted(
        collection: Collection[dict[str, Any]], writes: int, pauses: Sequence[float]
    ) -> dict[str, list[float]]:
        admin = collection.database.client.admin
        options = admin.command("getCmdLineOpts")
        seen["argv"] = options["argv"]
        seen["dbpath"] = options["parsed"]["storage"]["dbPath"]
        return timed(collection, writes, pauses)

    monkeypatch.setattr(write_modes, "_timed", noted)
    monkeypatch.setattr(write_modes, "BLOCK", 3)
    monkeypatch.setattr(write_modes, "WARM_UP", 2)
    slept: list[float] = []
    monkeypatch.setattr(
        handoff_parts, "time", SimpleNamespace(sleep=slept.append, perf_counter=time.perf_counter)
    )
    times = write_modes.measure(str(tmp_path), 5, ["--journalCommitInterval", "7"], (0, 0.01))
    assert list(times) == [
        "w: 1, back to back",
        "w: 1, 10 ms after the previous reply",
        "majority, back to back",
        "majority, 10 ms after the previous reply",
    ]
    assert [len(values) for values in times.values()] == [5] * 4
    assert all(0 < value < 10 for values in times.values() for value in values)
    # Whole blocks of 3 until 2 + 5 of each kind: 9 of each; a pause before each of the
    # paused kinds' writes, none before the others'.
    assert slept == [0.01] * 18
    assert "--journalCommitInterval" in seen["argv"]
    assert seen["argv"][seen["argv"].index("--journalCommitInterval") + 1] == "7"
    assert Path(seen["dbpath"]).parent == tmp_path
    assert not os.listdir(tmp_path)
    assert [node.running for replica_set in started for node in replica_set.nodes] == [False]


def test_a_run_that_fails_leaves_no_server_and_no_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = _started_sets(monkeypatch)

    def broken(*_: object) -> dict[str, list[float]]:
        raise RuntimeError("the server went away")

    monkeypatch.setattr(write_modes, "_timed", broken)
    with pytest.raises(RuntimeError, match="went away"):
        write_modes.measure(str(tmp_path), 5)
    assert not os.listdir(tmp_path)
    assert [node.running for replica_set in started for node in replica_set.nodes] == [False]


def _started_sets(monkeypatch: pytest.MonkeyPatch) -> list[MongoReplicaSet]:
    """The replica sets the probe makes from now on, as it made them."""
    made: list[MongoReplicaSet] = []

    class Recorded(MongoReplicaSet):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(write_modes, "MongoReplicaSet", Recorded)
    return made


def test_bad_arguments_are_refused_before_any_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_modes, "measure", lambda *a: pytest.fail("must not start"))
    wrong = (
        ["0"],
        ["-3"],
        ["5", "--dirs", str(tmp_path / "missing")],
        ["5", "--pauses", "1,x"],
        ["5", "--pauses", "-1"],
        ["5", "--pauses", "1001"],
        ["5", "--server-args", '"--unclosed'],
        ["5", "--dirs", "/proc"],  # no directory can be made there, even by root
    )
    for argv in wrong:
        with pytest.raises(SystemExit) as exited:
            write_modes.main(argv)
        assert exited.value.code == 2
