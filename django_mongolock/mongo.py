"""The driver's side, without I/O: how documents are decoded, what its errors mean, what
may be sent again, and how server addresses and credentials appear in messages.

Every store runs its queries inside ``Translate``, so that callers see this package's
errors (``ServerUnavailable``, ``ReplicaSetRequired``, ``MongoLockError``) naming the
servers but never a password.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC
from types import TracebackType
from typing import Any, Final, Protocol

from bson.codec_options import CodecOptions
from pymongo.client_options import ClientOptions
from pymongo.collection import Collection
from pymongo.errors import (
    AutoReconnect,
    ConnectionFailure,
    OperationFailure,
    PyMongoError,
    WriteConcernError,
    WriteError,
)
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from django_mongolock.exceptions import MongoLockError, ReplicaSetRequired, ServerUnavailable

__all__ = [
    "CODEC",
    "DOCUMENT_REFUSED",
    "HISTORY_LOST",
    "NAMESPACE_NOT_FOUND",
    "RETRYABLE_CODES",
    "Translate",
    "brief",
    "checked",
    "majority",
    "operation_limit",
    "redact",
    "retryable",
    "transaction_retryable",
]

# Dates come back as aware UTC datetimes, as the server's clock wrote them.
CODEC: Final[CodecOptions[Any]] = CodecOptions(tz_aware=True, tzinfo=UTC)
# Codes the server answers when $$CLUSTER_TIME is used on a standalone mongod.
NO_CLUSTER_TIME: Final = frozenset({51144, 10071})
# Server errors after which the driver retries a write (not primary, shutting down,
# stepped down, network, time limit): the same set applies to the acquire command.
RETRYABLE_CODES: Final = frozenset(
    {6, 7, 89, 91, 134, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436}
)
# ChangeStreamFatalError, ChangeStreamHistoryLost: the resume token cannot be used again.
HISTORY_LOST: Final = frozenset({280, 286})
# DocumentValidationFailure: the server refuses this document's write (a validator).
DOCUMENT_REFUSED: Final = 121
# The collection does not exist (yet): it has no indexes.
NAMESPACE_NOT_FOUND: Final = 26
_AUTHENTICATION_FAILED: Final = 18


def operation_limit(options: ClientOptions) -> float:
    """The time limit of one lock operation on a client with these options, in seconds.

    The client's ``timeoutMS`` when it sets one (a manager's own clients set it to the
    server selection timeout), else its server selection timeout, also for
    ``timeoutMS=0`` (no limit), so that no lock operation hangs: a lock operation runs
    under it as a whole (``pymongo.timeout``), and must not widen the limit a client
    given to the manager was built with.
    """
    limit = options.timeout
    return float(limit) if limit else float(options.server_selection_timeout)


def majority(collection: Collection[Any]) -> Collection[Any]:
    """``collection`` as every lock query uses it: majority writes and reads, UTC dates."""
    return collection.with_options(
        codec_options=CODEC,
        write_concern=WriteConcern(w="majority"),
        read_concern=ReadConcern("majority"),
    )


class _Described(Protocol):
    """What error messages need to know of a store: the servers and the timeout."""

    def servers(self) -> list[str]: ...

    @property
    def timeout(self) -> float: ...


class Translate:
    """Turns driver errors into this package's errors, naming the servers but no credentials."""

    __slots__ = ("_store",)

    def __init__(self, store: _Described) -> None:
        self._store = store

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or not isinstance(exc, PyMongoError):
            return
        if _authentication_failed(exc):
            # The driver's frames hold the password in local variables, which error pages
            # (Django's DEBUG page) and error reporters print: drop them.
            _without_frames(exc)
        store = self._store
        if isinstance(exc, OperationFailure) and (
            exc.code in NO_CLUSTER_TIME or "CLUSTER_TIME" in str(exc)
        ):
            raise ReplicaSetRequired(store.servers()) from exc
        # "Not primary", "shutting down" and the like in a reply are the server being
        # unavailable for writes just now, as much as a network error is.
        unavailable = isinstance(exc, OperationFailure) and exc.code in RETRYABLE_CODES
        if isinstance(exc, ConnectionFailure) or getattr(exc, "timeout", False) or unavailable:
            raise ServerUnavailable(store.servers(), store.timeout, brief(str(exc))) from exc
        raise MongoLockError(f"MongoDB error: {redact(str(exc))}") from exc


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors chained to it, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _authentication_failed(exc: BaseException) -> bool:
    return any(
        isinstance(error, OperationFailure) and error.code == _AUTHENTICATION_FAILED
        for error in _chain(exc)
    )


def _without_frames(exc: BaseException) -> None:
    for error in _chain(exc):
        error.__traceback__ = None


def transaction_retryable(exc: PyMongoError) -> bool:
    """Whether a transaction that failed before its commit may run again from the start."""
    return (
        exc.has_error_label("TransientTransactionError")
        or exc.has_error_label("RetryableWriteError")
        or isinstance(exc, ConnectionFailure)
    )


def retryable(exc: PyMongoError) -> bool:
    """Whether a failed acquisition may be sent again: the errors the driver retries writes on.

    A timeout of the operation's own budget is not retried (there is no time left).
    """
    if exc.timeout:  # server selection, network or execution time ran out
        return False
    if isinstance(exc, AutoReconnect):  # network errors and "not primary"
        return True
    return isinstance(exc, OperationFailure) and exc.code in RETRYABLE_CODES


def checked(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply, unless it reports a write or write concern failure (in an ``ok`` reply)."""
    for error in reply.get("writeErrors") or ():
        raise WriteError(error.get("errmsg", "write failed"), error.get("code"), reply)
    error = reply.get("writeConcernError")
    if error:
        raise WriteConcernError(
            error.get("errmsg", "write concern failed"), error.get("code"), reply
        )
    return reply


_CREDENTIALS: Final = re.compile(r"(mongodb(?:\+srv)?://)[^@/\s]*@")


def redact(text: str) -> str:
    """Drop ``user:password@`` from any connection string quoted in a message."""
    return _CREDENTIALS.sub(r"\1***@", text)


def brief(text: str) -> str:
    """The driver's first sentence, without its dump of timeouts and topology."""
    for cut in (" (configured timeouts", ", Timeout:", ", Topology Description:"):
        text = text.split(cut, 1)[0]
    return redact(text)
