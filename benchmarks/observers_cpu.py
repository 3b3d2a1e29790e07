"""What each set of observers costs the calling thread's CPU, per uncontended cycle.

``python -m benchmarks.observers_cpu [BLOCKS [CYCLES]]`` (default 8 blocks of 500 cycles)
runs the whole acquire+release call with the manager's store answering from a reply it
recorded from the server (``client_cpu.replayed``), each cycle after a real floor cycle,
as in a real cycle, where the driver's work comes between. The instrumentation
workload's sets of observers (``labels.INSTRUMENTED``) take turns by block, each
installed for its block and removed after it. Their threads' work runs beside the
timed cycles as in a real process, but for what is queued when the block ends (done
untimed at the removal): blocks of fewer cycles than a few batch delays (0.2 s) would
leave much of it out.

Only the calling thread's CPU is timed (``time.thread_time_ns``): what an observer costs
the lock's caller, without the server's noise that the instrumentation workload's
wall-clock figure carries. The work an observer hands to a thread of its own is not in
it; that workload's *CPU added* counts every thread. Per block, the median per cycle;
the table gives the median over blocks (min to max), and the difference to *nothing
subscribed* taken block by block.

Against the server in ``MONGOLOCK_URL``, or a development server started for the run.
See docs/performance.md.
"""

from __future__ import annotations

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

__all__ = ["main", "measure", "report"]

USAGE: Final = "[BLOCKS [CYCLES]]"
BASELINE: Final = INSTRUMENTED[0][0]


def measure(url: str, blocks: int, cycles: int) -> dict[str, list[float]]:
    """Per set of observers (by label), per block, the median thread CPU (µs) of one
    replayed cycle after a floor cycle. A first block warms up and is left out. A set
    whose modules are not installed is left out."""
    sets = [(label, spec) for label, spec in INSTRUMENTED if not instruments.missing(spec)]
    medians: dict[str, list[float]] = {label: [] for label, _ in sets}
    clock = time.thread_time_ns
    with manager_and_floor(url) as (manager, floor):
        floored = floor_cycle(floor)
        with replayed(manager):
            for block in range(blocks + 1):
                for label, spec in sets:
                    spent = []
                    uninstall = instruments.instrument(spec)
                    try:
                        for _ in range(cycles):
                            floored(random_key())
                            started = clock()
                            replayed_cycle(manager)
                            spent.append(clock() - started)
                    finally:
                        uninstall()
                    if block:
                        medians[label].append(statistics.median(spent) / 1e3)
    return medians


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
