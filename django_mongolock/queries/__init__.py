"""Every query of the package, built as plain data: filters, pipelines, commands.

No I/O here: the sync and async stores send what these functions build, so both APIs
share every guarantee, and a query can be read (and tested) without a server.

- ``common``: the expressions all lock queries share (liveness, projection, tokens);
- ``acquiring``: the acquire upsert, and what its reply means;
- ``leases``: refresh, release, leaving a line;
- ``handing``: what a release writes: the key freed, or handed to the first waiter;
- ``inspection``: find, list, count, force release;
- ``records``: process heartbeats and the audit trail;
- ``indexes``: the indexes to keep, and the plan to get there;
- ``changes``: the change stream filter of freed keys and of a process's handoffs.
"""

from __future__ import annotations

from django_mongolock.queries.acquiring import Acquire, acquire, check_limit, refused
from django_mongolock.queries.changes import FREED_EVENTS, reaches, wakeups
from django_mongolock.queries.common import (
    CLUSTER_TOKEN,
    COMPACT_AT,
    ENDED_KEEP,
    FIELDS,
    HANDOFF_LEASE_MS,
    HELD,
    LINE_CHECK_MS,
    LIVE,
    LIVE_HOLDERS,
    LIVE_WAITERS,
    MAX_HOLDERS,
    MAX_WAITERS,
    PLACE_GRACE_MS,
    PROJECTION,
)
from django_mongolock.queries.handing import HEAD_MARK, head_owner
from django_mongolock.queries.indexes import (
    AUDIT_KEY_INDEX,
    AUDIT_TTL_INDEX,
    KEY_INDEX,
    PROCESS_TTL_INDEX,
    TTL_INDEX,
    TTLIndex,
    plan_keyed,
    plan_locks,
)
from django_mongolock.queries.inspection import (
    COUNTED,
    SORTS,
    at_tokens,
    counts,
    find,
    find_many,
    force_release,
    listing,
)
from django_mongolock.queries.leases import (
    REFRESH_MANY_PIPELINE,
    REFRESHED_LIVE,
    RELEASE_PIPELINE,
    SHARED_LEASES,
    Release,
    Update,
    give_up,
    handing_release,
    leave,
    live_shared_owners,
    refresh,
    refresh_many,
    refresh_shared,
    refresh_shared_many,
    release,
    release_many,
    release_shared,
    release_shared_many,
    release_writes,
    released_live,
    shared_leases_filter,
    still_freed,
)
from django_mongolock.queries.records import (
    HEARTBEAT_SLACK,
    HISTORY_SORT,
    LIVENESS,
    audit_record,
    heartbeats,
    liveness,
)

__all__ = [
    "AUDIT_KEY_INDEX",
    "AUDIT_TTL_INDEX",
    "CLUSTER_TOKEN",
    "COMPACT_AT",
    "COUNTED",
    "ENDED_KEEP",
    "FIELDS",
    "FREED_EVENTS",
    "HANDOFF_LEASE_MS",
    "HEAD_MARK",
    "HEARTBEAT_SLACK",
    "HELD",
    "HISTORY_SORT",
    "KEY_INDEX",
    "LINE_CHECK_MS",
    "LIVE",
    "LIVENESS",
    "LIVE_HOLDERS",
    "LIVE_WAITERS",
    "MAX_HOLDERS",
    "MAX_WAITERS",
    "PLACE_GRACE_MS",
    "PROCESS_TTL_INDEX",
    "PROJECTION",
    "REFRESHED_LIVE",
    "REFRESH_MANY_PIPELINE",
    "RELEASE_PIPELINE",
    "SHARED_LEASES",
    "SORTS",
    "TTL_INDEX",
    "Acquire",
    "Release",
    "TTLIndex",
    "Update",
    "acquire",
    "at_tokens",
    "audit_record",
    "check_limit",
    "counts",
    "find",
    "find_many",
    "force_release",
    "give_up",
    "handing_release",
    "head_owner",
    "heartbeats",
    "leave",
    "listing",
    "live_shared_owners",
    "liveness",
    "plan_keyed",
    "plan_locks",
    "reaches",
    "refresh",
    "refresh_many",
    "refresh_shared",
    "refresh_shared_many",
    "refused",
    "release",
    "release_many",
    "release_shared",
    "release_shared_many",
    "release_writes",
    "released_live",
    "shared_leases_filter",
    "still_freed",
    "wakeups",
]
