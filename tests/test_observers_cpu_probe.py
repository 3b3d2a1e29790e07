"""The observers' CPU probe (``benchmarks.observers_cpu``): each set of observers is
measured in every block and removed after it, and the report subtracts block by block."""

from __future__ import annotations

import contextlib
from collections import Counter
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


def test_each_set_is_measured_in_every_block_with_its_own_observers(
    mongolock_url: str, probe_collections: None, only_listener: None
) -> None:
    seen: list[tuple[events.Observer, ...]] = []
    installed: list[tuple[events.Observer, ...]] = []
    swap, instrument = observers_cpu.subscribed, instruments.instrument

    @contextlib.contextmanager
    def watched(observers: tuple[events.Observer, ...]) -> Iterator[None]:
        with swap(observers):
            seen.append(events.observers())  # what the timed cycle is told
            yield

    def recorded(spec: str) -> Callable[[], None]:
        uninstall = instrument(spec)
        installed.append(events.observers())  # one observer per name, in the spec's order
        return uninstall

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(observers_cpu, "subscribed", watched)
        patch.setattr(instruments, "instrument", recorded)
        medians = observers_cpu.measure(mongolock_url, blocks=2, cycles=20)
    sets = [(label, spec) for label, spec in INSTRUMENTED if not instruments.missing(spec)]
    assert list(medians) == [label for label, _ in sets]
    assert all(len(blocks) == 2 and min(blocks) > 0 for blocks in medians.values())
    # One install of every observer, then three blocks (one to warm up) of 20 cycles of
    # each set, each told its own observers: none for the baseline, the metrics' and the
    # spans' for both.
    (everything,) = installed
    names = list(dict.fromkeys(n for _, spec in sets for n in spec.split("+") if n))
    observer = dict(zip(names, everything, strict=True))
    wanted = [tuple(observer[n] for n in spec.split("+") if n) for _, spec in sets]
    assert Counter(seen) == Counter(dict.fromkeys(wanted, 60))
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
