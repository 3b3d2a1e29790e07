"""Every MongoDB query of the package is sent from here, free of Django.

One document per key, keyed by ``_id`` so that two documents for one key cannot
exist even before ``migrate_mongolock`` has created the indexes. Every decision
about time is made by the server (``$$NOW``) inside the query, and fencing
tokens come from the cluster time, so they keep growing after the document is
deleted and across a failover. The queries themselves are built by ``queries``;
each method here sends one and reads its reply:

- ``holder``: acquire, refresh, release (alone or in bulk);
- ``operator``: find, list, count, force release, the lock collection's indexes;
- ``records``: process heartbeats, the audit trail and the run requests of
  ``on_busy="coalesce"``, with their indexes.
"""

from __future__ import annotations

from django_mongolock.store.holder import HolderQueries, Kept
from django_mongolock.store.operator import OperatorQueries
from django_mongolock.store.records import RecordQueries

__all__ = ["Kept", "LockStore"]


class LockStore(HolderQueries, OperatorQueries, RecordQueries):
    """The lock collection: atomic, server-timed operations on one document per key."""
