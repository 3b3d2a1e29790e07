"""``manage.py mongolock``: list and inspect locks, and force-release a stuck one."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Final

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_mongolock import conf
from django_mongolock.exceptions import MongoLockError
from django_mongolock.exitcodes import EXIT_ERROR, EXIT_HOLDER_ALIVE, EXIT_NO_LOCK
from django_mongolock.info import AuditEntry, LockInfo, Order, State
from django_mongolock.management.arguments import (
    EPILOG,
    HISTORY,
    LIST,
    ORDERS,
    RELEASE,
    STATUS,
    HelpFormatter,
    add_subcommands,
)
from django_mongolock.manager import LockManager
from django_mongolock.terminal import age, liveness, printable, relative, timestamp, who
from django_mongolock.validation import validate_key

# Column widths come from the first rows only, so that a listing of any length streams;
# a longer value later overflows its column instead of being cut (keys must stay whole
# to be copied into `mongolock release`).
_WIDTH_SAMPLE: Final = 1000
_MAX_KEY_WIDTH: Final = 60
_MAX_OWNER_WIDTH: Final = 48
_MAX_REASON_WIDTH: Final = 60


class Command(BaseCommand):
    help = (
        "List and inspect django-mongolock locks, and force-release a stuck one "
        "(the holder then finds its lock lost at its next refresh)."
    )
    # Runs when the checks fail (say, MongoDB is down): that is when operators need it.
    requires_system_checks: list[str] = []

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("epilog", EPILOG)
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        add_subcommands(parser)

    def handle(self, *args: Any, subcommand: str, verbosity: int, **options: Any) -> None:
        try:
            key = validate_key(options["key"]) if subcommand != LIST else ""
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        try:
            manager = conf.get_manager()
            if subcommand == RELEASE:
                self._release(
                    manager,
                    key,
                    options["token"],
                    verbosity,
                    force=options["force"],
                    reason=options["reason"],
                )
            elif subcommand == HISTORY:
                self._history(manager, key, options["limit"], options["as_json"], verbosity)
            elif subcommand == STATUS:
                self._status(manager, key, options["as_json"], verbosity)
            else:
                order: str = options["order"]
                self._list(
                    manager,
                    options["state"],
                    options["prefix"],
                    options["owner"],
                    ORDERS[order, options["reverse"]],
                    options["as_json"],
                    verbosity,
                )
        except MongoLockError as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc

    # -- subcommands -------------------------------------------------------------------------

    def _release(
        self,
        manager: LockManager,
        key: str,
        token: int | None,
        verbosity: int,
        *,
        force: bool,
        reason: str,
    ) -> None:
        if not force:
            # Release exactly the lease that was found dead or unknown: one taken since
            # by a live process is left alone (then the token no longer matches).
            token = self._refuse_alive(manager, key, token)
        try:
            info = manager.force_release(key, token=token, reason=reason)
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        if info is None:
            current = manager.status(key) if token is not None else None
            if current is not None:
                raise CommandError(
                    f"lock {key!r} now has token {current.token}, not {token} "
                    f"(held by {printable(current.owner)}); nothing released",
                    returncode=EXIT_NO_LOCK,
                )
            raise CommandError(f"no lock {key!r}", returncode=EXIT_NO_LOCK)
        if verbosity < 1:
            return
        if info.live:
            head = self.style.SUCCESS(f"Released {key!r}")
            lease = f"its lease would have ended {relative(info.remaining)}"
        else:
            head = self.style.SUCCESS(f"Removed the expired lock {key!r}")
            lease = f"its lease ended {relative(info.remaining)}"
        self.stdout.write(
            f"{head}: held by {who(info)} (token {info.token}), acquired "
            f"{relative(-age(info))}; {lease}."
        )
        if verbosity >= 2:
            why = f": {printable(reason)}" if reason else " (no reason given)"
            self.stdout.write(f"Recorded in the audit trail{why}.")

    def _refuse_alive(self, manager: LockManager, key: str, token: int | None) -> int | None:
        """The token to release at; CommandError unless the lease ended or its holder is dead.

        A holder whose liveness is unknown (no heartbeat yet, a lease kept without the
        refresher, a shared lease) may be running: only --force breaks it.
        """
        current = manager.status(key)
        if current is None or (token is not None and current.token != token):
            return token  # force_release finds nothing and says so
        if not current.live or current.holder_alive is False:
            return current.token
        if current.holder_alive:
            silent = current.holder_silent_for or 0.0
            state = f"whose process is alive (last heartbeat {relative(-silent)})"
        else:
            state = "whose process is not known to be dead (no heartbeat from it yet)"
        raise CommandError(
            f"lock {key!r} is held by {who(current)} (token {current.token}), {state}, and "
            f"its lease ends {relative(current.remaining)}; nothing released. Stop the "
            "holder, wait for the lease to end, or pass --force to break its lock anyway.",
            returncode=EXIT_HOLDER_ALIVE,
        )

    def _history(
        self, manager: LockManager, key: str, limit: int, as_json: bool, verbosity: int
    ) -> None:
        try:
            entries = manager.history(key, limit=limit)
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        if verbosity < 1:
            return
        if as_json:
            for entry in entries:
                self.stdout.write(json.dumps(entry.as_dict(), ensure_ascii=True))
            return
        if not entries:
            self.stdout.write(f"No force releases of {key!r} on record.")
            return
        self._history_table(entries)

    def _history_table(self, entries: Iterable[AuditEntry]) -> None:
        rows = [
            (
                timestamp(entry.at),
                printable(entry.by),
                printable(entry.owner) + (" (expired)" if entry.expired else ""),
                str(entry.token),
                printable(entry.reason)[:_MAX_REASON_WIDTH] or "-",
            )
            for entry in entries
        ]
        heads = ("WHEN", "BY", "OWNER", "TOKEN", "REASON")
        widths = [max(len(head), *(len(row[i]) for row in rows)) for i, head in enumerate(heads)]
        widths[1] = min(widths[1], _MAX_OWNER_WIDTH)
        widths[2] = min(widths[2], _MAX_OWNER_WIDTH)

        def line(cells: tuple[str, ...]) -> str:
            return "  ".join(
                f"{cell:>{width}}" if i == 3 else f"{cell:<{width}}"
                for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        self.stdout.write(self.style.MIGRATE_HEADING(line(heads)))
        for row in rows:
            self.stdout.write(line(row))
        self.stdout.write(f"{len(rows)} force release{_s(len(rows))}")

    def _status(self, manager: LockManager, key: str, as_json: bool, verbosity: int) -> None:
        info = manager.status(key)
        if info is None:
            raise CommandError(f"no lock {key!r}", returncode=EXIT_NO_LOCK)
        if verbosity < 1:
            return
        if as_json:
            self.stdout.write(_json(info))
            return
        refreshed = (info.refreshed_at - info.now).total_seconds()
        rows: list[tuple[str, str]] = [
            ("key", printable(info.key)),
            ("state", self._state(info, width=0)),
            ("owner", printable(info.owner)),
            ("token", str(info.token)),
            ("acquired", f"{timestamp(info.acquired_at)} ({relative(-age(info))})"),
            ("refreshed", f"{timestamp(info.refreshed_at)} ({relative(refreshed)})"),
            (
                "expires" if info.live else "expired",
                f"{timestamp(info.expires_at)} ({relative(info.remaining)})",
            ),
            ("ttl", f"{info.ttl:g}s"),
            ("process", _process(info)),
            ("server time", timestamp(info.now)),
        ]
        if not info.owner:
            rows[2] = ("holders", who(info))
        if info.group:
            rows.append(("group", printable(info.group)))
        if info.kind == "election":
            rows.append(("role", "elected leader"))
        if info.waiting:
            rows.append(("waiting", str(info.waiting)))
        for label, value in rows:
            self.stdout.write(f"{label + ':':<13}{value}")
        for holder in info.holders:
            live = "live" if holder.expires_at > info.now else "expired"
            self.stdout.write(
                f"  {printable(holder.owner)}  token {holder.token}  {live}, lease ends "
                f"{relative((holder.expires_at - info.now).total_seconds())}"
            )

    def _list(
        self,
        manager: LockManager,
        state: State,
        prefix: str | None,
        owner: str | None,
        order: Order,
        as_json: bool,
        verbosity: int,
    ) -> None:
        if verbosity < 1:
            manager.count(state, prefix, owner)  # still report a server that cannot answer
            return
        rows = _with_liveness(manager, manager.iter_locks(state, prefix, owner=owner, order=order))
        try:
            if as_json:
                for info in rows:
                    self.stdout.write(_json(info))
            else:
                self._table(rows, state)
        except BrokenPipeError:
            # `mongolock list | head`: the reader left; stop quietly, as Unix tools do.
            _detach_stdout()

    def _table(self, rows: Iterator[LockInfo], state: State) -> None:
        sample = list(itertools.islice(rows, _WIDTH_SAMPLE))
        if not sample:
            self.stdout.write(f"No {'' if state == 'all' else state + ' '}locks.")
            return
        key_width = min(_MAX_KEY_WIDTH, max(3, *(len(printable(info.key)) for info in sample)))
        owner_width = min(_MAX_OWNER_WIDTH, max(5, *(len(who(info)) for info in sample)))
        token_width = max(5, *(len(str(info.token)) for info in sample))
        header = (
            f"{'KEY':<{key_width}}  {'STATE':<7}  {'OWNER':<{owner_width}}  "
            f"{'TOKEN':>{token_width}}  {'ACQUIRED':<9}  {'EXPIRES':<9}  PROCESS"
        )
        self.stdout.write(self.style.MIGRATE_HEADING(header))
        count = 0
        for info in itertools.chain(sample, rows):
            self.stdout.write(
                f"{printable(info.key):<{key_width}}  {self._state(info, 7)}  "
                f"{who(info):<{owner_width}}  "
                f"{info.token:>{token_width}}  {relative(-age(info)):<9}  "
                f"{relative(info.remaining):<9}  {_process(info, brief=True)}"
            )
            count += 1
        self.stdout.write(f"{count} {'' if state == 'all' else state + ' '}lock{_s(count)}")

    def _state(self, info: LockInfo, width: int) -> str:
        text = f"{info.state:<{width}}"
        return self.style.SUCCESS(text) if info.live else self.style.WARNING(text)


def _with_liveness(manager: LockManager, rows: Iterator[LockInfo]) -> Iterator[LockInfo]:
    """``rows`` with their holders' liveness: one query per batch, never per lock."""
    while batch := list(itertools.islice(rows, _WIDTH_SAMPLE)):
        yield from manager.store.with_liveness(batch)


def _process(info: LockInfo, *, brief: bool = False) -> str:
    """Whether the holder's process is alive, by its heartbeats (server time)."""
    state, silent = liveness(info)
    if state == "unknown":
        return "-" if brief else "unknown (no heartbeat on record)"
    if state == "alive":
        return "alive" if brief else f"alive (last heartbeat {relative(-silent)})"
    return (
        f"silent {relative(silent).removeprefix('in ')}"
        if brief
        else (f"not alive (silent for {relative(silent).removeprefix('in ')})")
    )


def _s(count: int) -> str:
    return "" if count == 1 else "s"


def _detach_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _json(info: LockInfo) -> str:
    """One line of JSON, exact and pure ASCII: control characters, bidi controls and any
    other non-ASCII character are ``\\uXXXX`` escapes, which every JSON parser decodes back to
    the key as stored, and no terminal acts on."""
    return json.dumps(info.as_dict(), ensure_ascii=True)
