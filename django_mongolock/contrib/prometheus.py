"""Prometheus metrics of this process's locks (``pip install django-mongolock[prometheus]``).

``install()`` subscribes one observer to ``django_mongolock.events`` and registers the
metrics below in a ``prometheus_client`` registry (the default one, which
django-prometheus and ``prometheus_client.start_http_server`` export). Labels stay
bounded: outcome, mode, reason; the key becomes a label only through ``key_label``, a
function the caller gives that maps a key to one of few values (a key's prefix, say).

The caller's thread only queues each event; the metrics are updated on a thread of the
extra's own (``mongolock-metrics``, ``contrib.backlog``), a fraction of a second later.
``prometheus_client`` takes a lock for every counter and histogram update, six per
acquire and release: tens of microseconds in a thread whose caches the round trip just
cooled. The metrics reach their registry as one collector (``LockMetrics.collector``)
that applies the queued updates before it reads them, so a scrape never misses one
queued before it; ``flush()`` does the same for a reader of another kind. Past 8,192
events waiting, the next are applied in the caller's thread: none is lost.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypedDict

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from django_mongolock import events
from django_mongolock.contrib.backlog import Backlog

__all__ = ["LockMetrics", "flush", "install", "uninstall"]

# Waits run from one round trip to the caller's timeout; holds from milliseconds to hours.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 14400)
TICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _Unregistered(TypedDict):
    """The keywords every metric is built with."""

    namespace: str
    registry: None


class _Collector:
    """All the metrics, as one collector: a collection (a scrape, ``get_sample_value``)
    applies the queued updates first. One registration, so a registry holds all of them
    or none, and a scrape restricted to some names finds them by name."""

    def __init__(self, backlog: Backlog, metrics: Sequence[Any]) -> None:
        self.backlog = backlog
        self.metrics = tuple(metrics)

    def describe(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield from metric.describe()

    def collect(self) -> Iterator[Metric]:
        self.backlog.flush()
        # Read as a job: a fork meanwhile waits for the metrics' locks to be let go.
        with self.backlog.job:
            families = [family for metric in self.metrics for family in metric.collect()]
        yield from families


class LockMetrics:
    """The metrics and the observer that updates them; ``close()`` unsubscribes it.

    ``observe`` queues each event on ``backlog``; its thread updates the metrics.
    ``collector`` holds them all and goes into ``registry``; with ``registry=None`` it is
    registered nowhere: register it where the metrics should be read.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = REGISTRY,
        *,
        key_label: Callable[[str], str] | None = None,
        namespace: str = "mongolock",
    ) -> None:
        if key_label is not None and not callable(key_label):
            raise TypeError(f"key_label must be callable, not {type(key_label).__name__}")
        if not isinstance(namespace, str) or not namespace.isidentifier():
            raise ValueError(f"namespace must be an identifier, not {namespace!r}")
        self.key_label = key_label
        keyed = ("key",) if key_label is not None else ()
        # Each metric in no registry of its own: ``collector`` below registers them all.
        unregistered: _Unregistered = {"namespace": namespace, "registry": None}
        self.acquisitions = Counter(
            "acquisitions",
            "Calls to acquire that ended, by outcome (acquired, busy, timeout, error, cancelled).",
            ("outcome", "mode", *keyed),
            **unregistered,
        )
        self.releases = Counter(
            "releases",
            "Locks released by their holder.",
            ("mode", *keyed),
            **unregistered,
        )
        self.losses = Counter(
            "losses",
            "Locks their holder lost, by reason "
            "(expired, force-released, server-unreachable, refresh-failed).",
            ("reason", *keyed),
            **unregistered,
        )
        self.handoffs = Counter(
            "handoffs",
            "Locks handed from a holder to the next waiter.",
            keyed,
            **unregistered,
        )
        self.refresh_failures = Counter(
            "refresh_failures",
            "Refresher ticks whose write did not reach the server, or that it refused.",
            **unregistered,
        )
        self.acquire_wait = Histogram(
            "acquire_wait_seconds",
            "Time from a call to acquire until it returned or raised, by outcome.",
            ("outcome", *keyed),
            buckets=WAIT_BUCKETS,
            **unregistered,
        )
        self.hold = Histogram(
            "hold_seconds",
            "Time from acquiring a lock to its release or loss.",
            keyed,
            buckets=HOLD_BUCKETS,
            **unregistered,
        )
        self.tick = Histogram(
            "refresh_tick_seconds",
            "Duration of one refresher tick (the refresh and heartbeat writes).",
            buckets=TICK_BUCKETS,
            **unregistered,
        )
        self.lag = Histogram(
            "refresh_lag_seconds",
            "How late a refresher tick started after its due time.",
            buckets=TICK_BUCKETS,
            **unregistered,
        )
        self.held = Gauge(
            "held_locks",
            "Locks held in this process (taken since install).",
            **unregistered,
        )
        self.held.set_function(events.held_count)
        self.waiting = Gauge(
            "waiting_acquisitions",
            "Calls to acquire under way in this process (waiting or in flight).",
            **unregistered,
        )
        self.waiting.set_function(events.waiting_count)
        # After the metrics: one that failed to build leaves no thread or exit hook behind.
        self.backlog = Backlog("mongolock-metrics", overflow="run")
        self.collector = _Collector(
            self.backlog,
            (
                self.acquisitions,
                self.releases,
                self.losses,
                self.handoffs,
                self.refresh_failures,
                self.acquire_wait,
                self.hold,
                self.tick,
                self.lag,
                self.held,
                self.waiting,
            ),
        )
        if registry is not None:
            try:
                registry.register(self.collector)
            except BaseException:
                self.backlog.close()  # nothing registered, nothing subscribed
                raise
        self._registry = registry
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._unsubscribe: Callable[[], None] | None = events.subscribe(self.observe)

    def _keyed(self, key: str) -> tuple[str, ...]:
        return () if self.key_label is None else (str(self.key_label(key)),)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: the label sets are few, and
        ``labels()`` validates and locks on every call."""
        found = self._children.get((metric, labels))
        if found is None:
            found = self._children[metric, labels] = metric.labels(*labels) if labels else metric
        return found

    def observe(self, event: events.Event) -> None:
        """Queue the metrics' update for one event (the observer ``install`` subscribes)."""
        self.backlog.post(functools.partial(self.apply, event))

    def flush(self) -> None:
        """Apply, in this thread, the updates of every event observed so far."""
        self.backlog.flush()

    def apply(self, event: events.Event) -> None:
        """Update the metrics for one event (on the backlog's thread, a flushing reader's,
        or past the queue's limit the lock caller's)."""
        if isinstance(event, events.AcquireFinished):
            keyed = self._keyed(event.key)
            mode = "shared" if event.shared else "exclusive"
            self._child(self.acquisitions, event.outcome, mode, *keyed).inc()
            self._child(self.acquire_wait, event.outcome, *keyed).observe(event.waited)
        elif isinstance(event, events.Released):
            keyed = self._keyed(event.lock.key)
            mode = "shared" if event.lock.shared else "exclusive"
            self._child(self.releases, mode, *keyed).inc()
            if event.held_for is not None:
                self._child(self.hold, *keyed).observe(event.held_for)
        elif isinstance(event, events.Lost):
            keyed = self._keyed(event.lock.key)
            self._child(self.losses, event.reason, *keyed).inc()
            if event.held_for is not None:
                self._child(self.hold, *keyed).observe(event.held_for)
        elif isinstance(event, events.RefresherTick):
            self.tick.observe(event.duration)
            self.lag.observe(event.lag)
            if not event.ok:
                self.refresh_failures.inc()
        else:
            self._child(self.handoffs, *self._keyed(event.key)).inc()

    def close(self) -> None:
        """Stop observing, apply what is queued, and take the metrics out of their
        registry."""
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is None:
            return
        unsubscribe()
        self.backlog.close()
        if self._registry is not None:
            self._registry.unregister(self.collector)


_installed: LockMetrics | None = None
_mutex = threading.Lock()


def install(
    registry: CollectorRegistry | None = REGISTRY,
    *,
    key_label: Callable[[str], str] | None = None,
) -> LockMetrics:
    """Export this process's lock metrics (once: a second call returns the same metrics).

    Call it at start-up, e.g. in an ``AppConfig.ready()`` or a WSGI/ASGI module.
    """
    global _installed
    with _mutex:
        if _installed is None:
            _installed = LockMetrics(registry, key_label=key_label)
        return _installed


def uninstall() -> None:
    """Undo ``install()`` (tests, reloads)."""
    global _installed
    with _mutex:
        metrics, _installed = _installed, None
    if metrics is not None:
        metrics.close()


def flush() -> None:
    """Apply now, in this process, the updates of every lock event it queued: a scrape
    of the registry does it itself. Call it before reading a metric's value some other
    way, and in ``prometheus_client``'s multiprocess mode in a worker that ends without
    running ``atexit`` hooks (``os._exit``: a Celery prefork child, say, from Celery's
    ``worker_process_shutdown`` signal), lest its last updates never reach its file."""
    metrics = _installed
    if metrics is not None:
        metrics.flush()
