"""The observers' CPU probe (``benchmarks.observers_cpu``): each set of observers is
measured in every block and removed after it, and the report subtracts block by block."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from benchmarks import client_cpu, instruments, observers_cpu
from benchmarks.labels import INSTRUMENTED
from django_mongolock import events


@pytest.fixture
def probe_collections(mongolock_url: str) -> Iterator[None]:
    """The probe writes to the client CPU probe's collections: dropped after."""
    yield
    client_cpu.drop_collections(mongolock_url)


def test_each_set_is_measured_in_every_block_and_removed_after(
    mongolock_url: str, probe_collections: None, only_listener: None
) -> None:
    seen: list[bool] = []
    instrument = instruments.instrument

    def watched(spec: str) -> Callable[[], None]:
        uninstall = instrument(spec)
        seen.append(events.listening())  # installed for its block
        return uninstall

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(instruments, "instrument", watched)
        medians = observers_cpu.measure(mongolock_url, blocks=2, cycles=20)
    labels = [label for label, names in INSTRUMENTED if not instruments.missing(names)]
    assert list(medians) == labels
    assert all(len(blocks) == 2 and min(blocks) > 0 for blocks in medians.values())
    # Three blocks (one to warm up) of each set; only "nothing subscribed" subscribes none.
    assert seen == [False, *[True] * (len(labels) - 1)] * 3
    assert not events.listening()


def test_the_report_subtracts_the_baseline_block_by_block() -> None:
    medians = {
        "nothing subscribed": [100.0, 120.0, 90.0],
        "Prometheus metrics": [110.0, 125.0, 100.0],  # 10, 5 and 10 more
    }
    table = observers_cpu.report(medians)
    assert table[2] == "| nothing subscribed | 100.0 (90.0 to 120.0) | — |"
    assert table[3] == "| Prometheus metrics | 110.0 (100.0 to 125.0) | 10.0 (5.0 to 10.0) |"


@pytest.mark.parametrize("argv", [["1", "2", "3"], ["none"], ["0"], ["--replayed"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="expected"):
        observers_cpu._arguments(argv)
