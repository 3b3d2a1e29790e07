"""The run's markdown report, its JSON twin, and the plot of the handoff wait times."""

from __future__ import annotations

import importlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

from benchmarks import scale, sections
from benchmarks.goals import safety, targets
from benchmarks.labels import (
    DOCS_PAGE,
    DOCS_PLOT,
    FLOOR,
    FLOOR_POLL_10,
    FLOOR_POLL_100,
    FLOOR_TTL,
    OURS,
    OURS_TRY,
    PLOT_NAME,
    REDIS,
)
from benchmarks.markdown import table, x

__all__ = [
    "FLOOR",
    "FLOOR_POLL_10",
    "FLOOR_POLL_100",
    "FLOOR_TTL",
    "OURS",
    "OURS_TRY",
    "REDIS",
    "safety",
    "targets",
    "write",
]


def _met(met: bool | None) -> str:
    return "n/a" if met is None else "**met**" if met else "**missed**"


def _ratio(value: float, bound: float | None) -> str:
    """``value`` to three places, or to as many more (up to six) as it takes not to show
    the goal's own ``bound`` in place of a value beside it: 0.8996x, not 0.900x, for a
    goal of 0.9x missed."""
    digits = 3
    while (
        bound is not None and value != bound and digits < 6 and x(value, digits) == x(bound, digits)
    ):
        digits += 1
    return x(value, digits)


def _header(meta: dict[str, Any]) -> list[str]:
    load_start = ", ".join(f"{v:.2f}" for v in meta["load_start"])
    load_end = ", ".join(f"{v:.2f}" for v in meta.get("load_end", ()))
    where = "started for the run" if meta.get("mongodb_started_here") else "from MONGOLOCK_URL"
    redis = (
        f"{meta['redis']} on loopback, no persistence; python-redis-lock "
        f"{meta['python_redis_lock']}, redis-py {meta['redis_py']}"
        if meta.get("redis")
        else "not installed: python-redis-lock skipped"
    )
    minutes, seconds = divmod(round(meta.get("seconds", 0)), 60)
    engine = f"{meta['django_mongolock']}, commit {meta['commit'] or '?'}"
    if not meta.get("engine_in_tree", True):
        engine = f"{meta['django_mongolock']} imported from {meta['engine_path']}"
        if meta.get("engine_label"):  # MONGOLOCK_BENCH_ENGINE: what that copy is
            engine = f"{meta['django_mongolock']}, {meta['engine_label']}"
    rows = [
        ["date", meta["started"]],
        ["command", f"`{meta['command']}` ({meta['mode']} run)"],
        ["django-mongolock", engine],
        ["MongoDB", f"{meta.get('mongodb', '?')}, {meta.get('topology', '?')} ({where}), loopback"],
        *([["MongoDB storage", meta["mongodb_storage"]]] if "mongodb_storage" in meta else []),
        ["driver", f"pymongo {meta['pymongo']}"],
        ["Redis", redis],
        ["Python, Django", f"{meta['python']}, Django {meta['django']}"],
        [
            "machine",
            f"{meta['platform']}, {meta['usable_cores']} usable core(s) of {meta['cores']}",
        ],
        ["load average (1, 5, 15 min)", f"{load_start} at start; {load_end} at end"],
        ["run time", f"{minutes} min {seconds} s"],
    ]
    return table(["", ""], rows)


def render(
    meta: dict[str, Any], results: dict[str, Any], plot: str | None, scale_plot: str | None = None
) -> str:
    lines = [
        "# Benchmarks",
        "",
        "django-mongolock measured beside the fewest round trips a correct MongoDB lock can "
        "make (the *floor*: a lock written with the raw driver, acquire = one "
        "`find_one_and_update` upsert deciding with `$$NOW`, release = one `delete_one` by "
        "key and owner, waiting = polling) and python-redis-lock on a local Redis, in the "
        "same run, against the same servers, in interleaved rounds. "
        "[Where the time goes](performance.md) explains the figures.",
        "",
        "Reproduce with `make bench` (the full run, about twenty minutes; it rewrites this "
        "page), or `.venv/bin/python benchmarks/run.py --quick` for a one-minute run and "
        "`--only NAME` for one workload. The suite needs the `bench` extra "
        "(`pip install -e '.[bench]'`) and, for python-redis-lock, a `redis-server` on "
        "`PATH`; it starts its own single-node replica set unless `MONGOLOCK_URL` names one, "
        "with the WiredTiger cache and oplog that mongod sizes for the machine, as on a "
        "production server (the test suite's servers keep a small cache and oplog). "
        "The instrumentation workload measures the `prometheus` extra and "
        "`opentelemetry-sdk` where they are installed. "
        "Reports and JSON go to `benchmarks/results/`.",
        "",
        "!!! note",
        "    The machine is small and shared: read the ratios, which compare locks measured "
        "side by side in one run, rather than the absolute figures. Redis keeps its data "
        "in memory on one server; MongoDB acknowledges each lock write after a journaled "
        "majority commit, which is most of a round trip here.",
        "",
        "## Run",
        "",
        *_header(meta),
    ]
    rows = targets(results)
    if rows:
        lines += ["## Targets", ""]
        lines += table(
            ["target", "goal", "figure", "ratio", ""],
            [
                [
                    row["target"],
                    row["goal"],
                    row["figure"],
                    f"{_ratio(row['ratio'], row.get('bound'))} {row['ratio_to']}".strip(),
                    _met(row["met"]),
                ]
                for row in rows
            ],
        )
    if "uncontended" in results:
        lines += sections.uncontended(results["uncontended"])
    if "handoff" in results:
        lines += sections.handoff(results["handoff"], plot)
    if "many-keys" in results:
        lines += sections.many_keys(results["many-keys"])
    if "refresh" in results:
        lines += sections.refresh(results["refresh"])
    if "footprint" in results:
        lines += sections.footprint(results["footprint"], results.get("refresh"))
    if "admin" in results:
        lines += sections.admin(results["admin"])
    if "scale" in results:
        lines += scale.render(results["scale"], scale_plot)
    if "instrumentation" in results:
        lines += sections.instrumentation(results["instrumentation"])
    unsafe = safety(results)
    if unsafe:
        lines += sections.safety_table(unsafe)
    return "\n".join(lines).rstrip() + "\n"


# -- the plot -----------------------------------------------------------------------------------


def plot_waits(data: dict[str, Any], path: Path) -> bool:
    """Distribution (ECDF, log time axis) of the wait inside acquire per lock; False without
    matplotlib."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        print("notice: matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    figure, axes = pyplot.subplots(figsize=(8, 4.5), dpi=110)
    for label, row in data["rows"].items():
        waits = sorted(max(wait, 1e-5) * 1000 for wait in row["waits"])
        if not waits:
            continue
        shares = [(n + 1) / len(waits) for n in range(len(waits))]
        p99 = row["wait"]["p99"] * 1000
        axes.step(waits, shares, where="post", label=f"{label} (p99 {p99:.1f} ms)")
    axes.set_xscale("log")
    axes.set_xlabel("wait inside acquire (ms, log scale)")
    axes.set_ylabel("share of acquisitions")
    axes.set_ylim(0, 1.01)
    axes.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    axes.grid(True, which="both", linewidth=0.3)
    axes.set_title(
        f"{data['processes']} processes blocking on one key, holding it {data['hold'] * 1000:g} ms"
    )
    axes.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)
    return True


# -- writing ------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write(
    meta: dict[str, Any], results: dict[str, Any], directory: Path, *, docs: bool, root: Path
) -> list[Path]:
    """Write ``<stamp>.md``, ``<stamp>.json`` (and the plot) under ``directory``; with
    ``docs``, copy the report and the plot into the documentation."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = meta["started"].replace(":", "").replace("+0000", "Z").replace("-", "")
    written: list[Path] = []
    plot_path = directory / f"{stamp}-{PLOT_NAME}"
    has_plot = "handoff" in results and plot_waits(results["handoff"], plot_path)
    if has_plot:
        written.append(plot_path)
    scale_path = directory / f"{stamp}-{scale.PLOT_NAME}"
    has_scale = "scale" in results and scale.plot(results["scale"], scale_path)
    if has_scale:
        written.append(scale_path)
    markdown = directory / f"{stamp}.md"
    markdown.write_text(
        render(
            meta,
            results,
            plot_path.name if has_plot else None,
            scale_path.name if has_scale else None,
        )
    )
    written.append(markdown)
    data = {"meta": meta, "targets": targets(results), "safety": safety(results), **results}
    json_path = directory / f"{stamp}.json"
    json_path.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    written.append(json_path)
    for name, source in (("latest.md", markdown), ("latest.json", json_path)):
        shutil.copyfile(source, directory / name)
    if docs:
        page = root / DOCS_PAGE
        image = root / DOCS_PLOT
        if has_plot:
            image.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plot_path, image)
            written.append(image)
        if has_scale:
            scale_image = root / "docs" / "img" / scale.PLOT_NAME
            shutil.copyfile(scale_path, scale_image)
            written.append(scale_image)
        page.write_text(
            render(
                meta,
                results,
                "img/handoff-waits.png" if has_plot else None,
                f"img/{scale.PLOT_NAME}" if has_scale else None,
            )
        )
        written.append(page)
    return written
