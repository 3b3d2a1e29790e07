"""The command line of ``manage.py mongolock``: subcommands, options, help and exit statuses."""

from __future__ import annotations

from argparse import SUPPRESS, ArgumentParser
from typing import Final

from django.core.management.base import CommandParser, DjangoHelpFormatter

from django_mongolock.exitcodes import (
    BUSY_EXIT_CODE,
    EXIT_ERROR,
    EXIT_HOLDER_ALIVE,
    EXIT_NO_LOCK,
    EXIT_OK,
)
from django_mongolock.info import Order

__all__ = [
    "EPILOG",
    "EXIT_CODES",
    "HISTORY",
    "LIST",
    "ORDERS",
    "RELEASE",
    "STATUS",
    "HelpFormatter",
    "add_subcommands",
]

RELEASE: Final = "release"
LIST: Final = "list"
STATUS: Final = "status"
HISTORY: Final = "history"

ORDERS: Final[dict[tuple[str, bool], Order]] = {
    ("key", False): "key",
    ("key", True): "-key",
    ("expires", False): "expires",
    ("expires", True): "-expires",
    ("acquired", False): "acquired",
    ("acquired", True): "-acquired",
}

EXIT_CODES: Final = f"""\
exit status:
  {EXIT_OK}   done
  {EXIT_NO_LOCK}   no such lock (release, status)
  {EXIT_ERROR}   MongoDB could not be reached or refused; invalid settings or arguments
  {EXIT_HOLDER_ALIVE}   (release) the lease is live and its holder is not known to be dead: nothing
      released (see --force)
  {BUSY_EXIT_CODE}  (from commands decorated with @locked) the lock was busy: try again later
"""

EPILOG: Final = f"""\
examples:
  python manage.py mongolock list                         live locks, as a table
  python manage.py mongolock list --all --prefix invoice-
  python manage.py mongolock list --expired --json        expired locks, as JSON lines
  python manage.py mongolock status report-gen
  python manage.py mongolock release report-gen           refused while its holder lives
  python manage.py mongolock release report-gen --force --reason "stuck since noon"
  python manage.py mongolock history report-gen           who force-released it, and why

{EXIT_CODES}"""


class HelpFormatter(DjangoHelpFormatter):
    """Django's option order; text with line breaks (examples, exit codes) kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def add_subcommands(parser: CommandParser) -> None:
    """``release``, ``history``, ``list`` and ``status``, each with its options and help."""
    commands = parser.add_subparsers(
        dest="subcommand", required=True, metavar="subcommand", title="subcommands"
    )

    release = commands.add_parser(
        RELEASE,
        help="force-release a lock (refused while its holder may be alive)",
        description="Remove the lock KEY and print who held it. The former holder sees "
        "its lock as lost at its next refresh; its fencing token is stale from now on. "
        f"Refused (exit {EXIT_HOLDER_ALIVE}) while the lease is live and its holder is not "
        "known to be dead (it sends heartbeats, or has sent none yet), unless --force. "
        "Every release is recorded in the audit trail (see history), "
        "with your OS user@host. Exits 1 when there is no such lock.",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
    )
    _shared_options(release)
    release.add_argument("key", metavar="KEY", help="the lock's key")
    release.add_argument(
        "--token",
        type=int,
        metavar="TOKEN",
        help="release only while the lock still has this fencing token (so that a "
        "holder that took it since is left alone)",
    )
    release.add_argument(
        "--force",
        action="store_true",
        help="release even though the holder may be alive",
    )
    release.add_argument(
        "--reason",
        default="",
        metavar="TEXT",
        help="why, for the audit trail (see history)",
    )

    history = commands.add_parser(
        HISTORY,
        help="show who force-released a lock, when and why",
        description="The force releases of KEY still on record (AUDIT_RETENTION), "
        "newest first: when (server time), by whom, the former owner and token, and "
        "the reason. Exits 0, also when there are none.",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
    )
    _shared_options(history)
    history.add_argument("key", metavar="KEY", help="the lock's key")
    history.add_argument(
        "--limit", type=int, default=100, metavar="N", help="at most N entries (100)"
    )
    history.add_argument(
        "--json",
        dest="as_json",
        action="store_true",
        help="one JSON object per line (AuditEntry.as_dict()) instead of a table",
    )

    listing = commands.add_parser(
        LIST,
        help="list locks as a table or as JSON lines",
        description="List locks, streamed from the server in batches (any number of "
        "them). Times are relative to the server's clock.",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
    )
    _shared_options(listing)
    states = listing.add_mutually_exclusive_group()
    for state, text in (
        ("live", "only locks whose lease is running (the default)"),
        ("expired", "only expired locks (their holder died or lost them)"),
        ("all", "live and expired locks"),
    ):
        states.add_argument(
            f"--{state}", dest="state", action="store_const", const=state, help=text
        )
    listing.set_defaults(state="live")
    listing.add_argument("--prefix", metavar="P", help="only keys that start with P")
    listing.add_argument("--owner", metavar="TEXT", help="only owners that contain TEXT")
    listing.add_argument(
        "--order",
        choices=tuple(dict.fromkeys(name for name, _ in ORDERS)),
        default="key",
        help="sort by key (the default), lease end or acquisition time",
    )
    listing.add_argument("--reverse", action="store_true", help="sort descending")
    listing.add_argument(
        "--json",
        dest="as_json",
        action="store_true",
        help="one JSON object per line (LockInfo.as_dict()) instead of a table",
    )

    status = commands.add_parser(
        STATUS,
        help="show one lock in detail",
        description="Show the lock KEY: holder, fencing token, and its times. An "
        "expired lock is shown as expired (exit 0); exits 1 when there is none.",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
    )
    _shared_options(status)
    status.add_argument("key", metavar="KEY", help="the lock's key")
    status.add_argument(
        "--json",
        dest="as_json",
        action="store_true",
        help="one JSON object (LockInfo.as_dict()) instead of text",
    )


def _shared_options(parser: ArgumentParser) -> None:
    """Accept Django's common options after the subcommand too (``mongolock list -v0``).

    Given there, they override the ones before it; not given, they leave those alone.
    """
    parser.add_argument(
        "-v",
        "--verbosity",
        type=int,
        choices=[0, 1, 2, 3],
        default=SUPPRESS,
        help="0: errors only (the exit status tells the rest), 1: normal output",
    )
    for flag in ("--traceback", "--no-color", "--force-color"):
        parser.add_argument(flag, action="store_true", default=SUPPRESS, help=SUPPRESS)
