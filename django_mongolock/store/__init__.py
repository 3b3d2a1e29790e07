"""Every MongoDB query of the package is sent from here, free of Django.

One document per key, keyed by ``_id`` so that two documents for one key cannot
exist even before ``migrate_mongolock`` has created the indexes. Every decision
about time is made by the server (``$$NOW``) inside the query, and fencing
tokens come from the cluster time, so they keep growing after the document is
deleted and across a failover. The queries themselves are built by ``queries``;
each method here sends one and reads its reply:

- ``holder``: acquire, refresh, release (alone or in bulk);
- ``operator``: find, list, count, force release, the lock collection's indexes;
- ``records``: process heartbeats and the audit trail, with their indexes.
"""

from __future__ import annotations

# moved: AuditEntry, Holder, IndexAction, LockInfo, Order, State, process_of to
# django_mongolock.info; the index names and HEARTBEAT_SLACK to django_mongolock.queries;
# _redact to django_mongolock.mongo.redact. Re-imported until every importer uses those.
from django_mongolock.info import AuditEntry as AuditEntry
from django_mongolock.info import Holder as Holder
from django_mongolock.info import IndexAction as IndexAction
from django_mongolock.info import LockInfo as LockInfo
from django_mongolock.info import Order as Order
from django_mongolock.info import State as State
from django_mongolock.info import process_of as process_of
from django_mongolock.mongo import redact
from django_mongolock.queries import AUDIT_KEY_INDEX as AUDIT_KEY_INDEX
from django_mongolock.queries import AUDIT_TTL_INDEX as AUDIT_TTL_INDEX
from django_mongolock.queries import HEARTBEAT_SLACK as HEARTBEAT_SLACK
from django_mongolock.queries import KEY_INDEX as KEY_INDEX
from django_mongolock.queries import PROCESS_TTL_INDEX as PROCESS_TTL_INDEX
from django_mongolock.queries import TTL_INDEX as TTL_INDEX
from django_mongolock.store.holder import HolderQueries
from django_mongolock.store.operator import OperatorQueries
from django_mongolock.store.records import RecordQueries

__all__ = [
    "AUDIT_TTL_INDEX",
    "HEARTBEAT_SLACK",
    "KEY_INDEX",
    "PROCESS_TTL_INDEX",
    "TTL_INDEX",
    "AuditEntry",
    "IndexAction",
    "LockInfo",
    "LockStore",
    "Order",
    "State",
]

_redact = redact


class LockStore(HolderQueries, OperatorQueries, RecordQueries):
    """The lock collection: atomic, server-timed operations on one document per key."""
