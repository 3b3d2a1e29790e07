"""The observers' CPU probe (``benchmarks.observers_cpu``): each set of observers is
measured in every block and removed after it, and the report subtracts block by block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from benchmarks import client_cpu, instruments, observers_cpu
from benchmarks.labels import INSTRUMENTED
from django_mongolock import events


@pytest.fixture
def probe_collections(mongolock_url: str) -> Iterator[None]:
    """The probe writes to the client CPU probe's collections: dropped after."""
    yield
    client_cpu.drop_collections(mongolock_url)


def test_each_set_is_measured_in_every_block_with_its_own_observers(
    mongolock_url: str, probe_collections: None, only_listener: None
) -> None:
    seen: list[int] = []
    swap = observers_cpu.subscribed

    @contextlib.contextmanager
    def watched(observers: tuple[events.Observer, ...]) -> Iterator[None]:
        with swap(observers):
            seen.append(len(events._observers))  # what the timed cycle is told
            yield

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(observers_cpu, "subscribed", watched)
        medians = observers_cpu.measure(mongolock_url, blocks=2, cycles=20)
    sets = [(label, spec) for label, spec in INSTRUMENTED if not instruments.missing(spec)]
    assert list(medians) == [label for label, _ in sets]
    assert all(len(blocks) == 2 and min(blocks) > 0 for blocks in medians.values())
    # Three blocks (one to warm up) of 20 cycles of each set, each with its observers:
    # none for the baseline, two for metrics and spans.
    counts = sorted(len([n for n in spec.split("+") if n]) for _, spec in sets)
    assert sorted(seen) == sorted(counts * 60)
    assert not events.listening()  # all removed after the run


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
