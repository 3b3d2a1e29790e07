"""What each set of observers costs the calling thread's CPU, per uncontended cycle.

``python -m benchmarks.observers_cpu [BLOCKS [CYCLES]]`` (default 8 blocks of 500 cycles)
runs the whole acquire+release call with the manager's store answering from a reply it
recorded from the server (``client_cpu.replayed``), each cycle after a real floor cycle,
as in a real cycle, where the driver's work comes between. Every observer of the
instrumentation workload's sets (``labels.INSTRUMENTED``) is installed for the whole
run, and the sets take turns cycle by cycle, in an order shuffled every round, so that
all meet the same moments of a shared machine: before each cycle, the observers
subscribed are swapped for that set's (``subscribed``: outside the timed call, and the
same swap for every set). Their threads' work runs beside all the cycles. Refresher
ticks and losses, told on a notice worker, reach the set swapped in at that moment: the
untimed work they cause (the statistics' flush) is spread over the sets.

Only the calling thread's CPU is timed (``time.thread_time_ns``): what an observer costs
the lock's caller, without the server's noise that the instrumentation workload's
wall-clock figure carries. The work an observer hands to a thread of its own is not in
it (but for what it does to the caches it shares); that workload's *CPU added* counts
every thread. Per block, the median per cycle; the table gives the median over blocks
(min to max), and the difference to *nothing subscribed* taken block by block.

Against the server in ``MONGOLOCK_URL``, or a development server started for the run.
See docs/performance.md.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Final

from benchmarks import instruments
from benchmarks.client_cpu import (
    floor_cycle,
    manager_and_floor,
    probe_server,
    random_key,
    replayed,
    replayed_cycle,
)
from benchmarks.labels import INSTRUMENTED
from benchmarks.markdown import span, table
from django_mongolock import events

__all__ = ["main", "measure", "report"]

USAGE: Final = "[BLOCKS [CYCLES]]"
BASELINE: Final = INSTRUMENTED[0][0]


def measure(url: str, blocks: int, cycles: int) -> dict[str, list[float]]:
    """Per set of observers (by label), per block, the median thread CPU (µs) of one
    replayed cycle after a floor cycle. A first block warms up and is left out. A set
    whose modules are not installed is left out."""
    sets = [(label, spec) for label, spec in INSTRUMENTED if not instruments.missing(spec)]
    names = list(dict.fromkeys(name for _, spec in sets for name in spec.split("+") if name))
    medians: dict[str, list[float]] = {label: [] for label, _ in sets}
    clock = time.thread_time_ns
    with manager_and_floor(url) as (manager, floor), replayed(manager):
        floored = floor_cycle(floor)
        uninstall = instruments.instrument("+".join(names))
        try:
            observers = dict(zip(names, events.observers(), strict=True))  # in install order
            chosen = {
                label: tuple(observers[name] for name in spec.split("+") if name)
                for label, spec in sets
            }
            order = [label for label, _ in sets]
            for block in range(blocks + 1):
                spent: dict[str, list[int]] = {label: [] for label in order}
                for _ in range(cycles):
                    random.shuffle(order)
                    for label in order:
                        with subscribed(chosen[label]):
                            floored(random_key())
                            started = clock()
                            replayed_cycle(manager)
                            spent[label].append(clock() - started)
                if block:
                    for label in order:
                        medians[label].append(statistics.median(spent[label]) / 1e3)
        finally:
            uninstall()
    return medians


# ``with subscribed(observers)``: inside, those alone receive the lock events (the run's
# installed ones are put back after): one assignment each way, the same for every set.
subscribed = events.swapped


def report(medians: dict[str, list[float]]) -> list[str]:
    """A markdown table: each set's median per cycle over blocks, and what it adds to
    the baseline's (nothing subscribed), block by block."""
    baseline = medians[BASELINE]
    rows = []
    for label, values in medians.items():
        added = [value - base for value, base in zip(values, baseline, strict=True)]
        rows.append([label, span(values, 1), "—" if values is baseline else span(added, 1)])
    return table(["subscribed", "caller's CPU µs/cycle", "added, µs"], rows)


def _arguments(argv: Sequence[str]) -> list[int]:
    if len(argv) > 2 or not all(a.isdigit() and int(a) > 0 for a in argv):
        raise SystemExit(f"expected {USAGE}, not {' '.join(argv)!r}")
    return [int(a) for a in argv]


def main(argv: Sequence[str] | None = None) -> int:
    numbers = _arguments(sys.argv[1:] if argv is None else argv)
    blocks, cycles = (numbers + [8, 500][len(numbers) :])[:2]
    with probe_server() as url:
        print(f"{blocks} blocks of {cycles} cycles")
        print("\n".join(report(measure(url, blocks, cycles))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
