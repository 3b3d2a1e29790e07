"""The admin dashboard of live and expired locks, read straight from the MongoDB collection.

The ``Lock`` model has no table: it lends the admin its sidebar entry, URLs and permissions
(``view_lock``, ``release_lock``). Every page asks the server; paging, filtering and sorting
happen in MongoDB, so a collection of any size is never loaded whole. Force release deletes
a lock only at the fencing token the operator saw, so a lock that changed hands in between
is left to its new holder. A lock whose holder's process still sends heartbeats is
released only once the operator has ticked a box saying they know; every force release
is recorded in the audit trail with the user's name and reason, shown on the key's page.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import update_wrapper
from typing import TYPE_CHECKING, Any, Final, Literal, cast, get_args
from urllib.parse import quote as url_quote

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.admin.utils import quote, unquote
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.formats import number_format
from django.utils.http import RFC3986_SUBDELIMS, urlencode
from django.utils.text import capfirst
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop, ngettext
from django.views.generic import RedirectView

from django_mongolock.conf import get_manager
from django_mongolock.exceptions import (
    ConfigurationError,
    MongoLockError,
    ReplicaSetRequired,
    ServerUnavailable,
)
from django_mongolock.manager import LockManager
from django_mongolock.models import Lock
from django_mongolock.store import AuditEntry, IndexAction, LockInfo, Order, State
from django_mongolock.validation import validate_key

__all__ = ["LockAdmin"]

logger = logging.getLogger("django_mongolock.admin")

STATE_VAR: Final = "state"
SEARCH_VAR: Final = "q"
OWNER_VAR: Final = "owner"
ORDER_VAR: Final = "o"
PAGE_VAR: Final = "p"
REFRESH_VAR: Final = "refresh"
RELEASE_ACTION: Final = "release_selected"
CONFIRM_ALIVE_VAR: Final = "confirm_alive"
REASON_VAR: Final = "reason"
REASON_MAX: Final = 1000

_MISSING: Final = gettext_noop(
    "The lock “%(key)s” does not exist: it was released, or purged after it expired."
)

_ORDERS: Final[tuple[str, ...]] = get_args(Order)

Selection = tuple[str, int]
"""A lock the operator picked: its key and the fencing token the page showed."""


# -- formatting ---------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    """A short, translated length of time: ``250 ms``, ``4.2 s``, ``35 s``, ``3 min 5 s``."""
    span = abs(seconds)
    if round(span * 1000) < 1000:
        return _("%(milliseconds)d ms") % {"milliseconds": round(span * 1000)}
    tenths = round(span * 10)
    if tenths < 100 and tenths % 10:
        return _("%(seconds)s s") % {"seconds": number_format(tenths / 10, 1)}
    whole = round(span)
    if whole < 60:
        return _("%(seconds)s s") % {"seconds": whole}
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        if not secs:
            return _("%(minutes)d min") % {"minutes": minutes}
        return _("%(minutes)d min %(seconds)d s") % {"minutes": minutes, "seconds": secs}
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        if not minutes:
            return _("%(hours)d h") % {"hours": hours}
        return _("%(hours)d h %(minutes)d min") % {"hours": hours, "minutes": minutes}
    days, hours = divmod(hours, 24)
    if not hours:
        return _("%(days)d d") % {"days": days}
    return _("%(days)d d %(hours)d h") % {"days": days, "hours": hours}


def _absolute(moment: datetime) -> str:
    """Server time to the millisecond, always in UTC: the clock that decides expiry."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


@dataclass(frozen=True, slots=True)
class Moment:
    """A server time shown relative to the server's ``now``, with the absolute time on hover."""

    iso: str
    absolute: str
    relative: str

    @classmethod
    def of(cls, moment: datetime, now: datetime) -> Moment:
        seconds = (moment - now).total_seconds()
        if seconds > 0:
            relative = _("in %(duration)s") % {"duration": _duration(seconds)}
        else:
            relative = _("%(duration)s ago") % {"duration": _duration(seconds)}
        return cls(moment.astimezone(UTC).isoformat(), _absolute(moment), relative)


def _process(info: LockInfo) -> tuple[Literal["alive", "silent", "unknown"], str]:
    """The holder's process as the pages show it: alive, silent (for how long), or unknown."""
    silent = info.holder_silent_for
    if info.holder_alive is None or silent is None:
        return "unknown", ""
    if info.holder_alive:
        label = _("process alive (last heartbeat %(duration)s ago)")
        return "alive", label % {"duration": _duration(silent)}
    return "silent", _("process silent for %(duration)s") % {"duration": _duration(silent)}


def _may_be_alive(info: LockInfo | None) -> bool:
    """Whether releasing ``info`` needs the ticked box: its lease is live and its holder
    is not known to be dead (alive, or no heartbeat from it yet: refresh=False, shared,
    or taken less than a third of the ttl ago)."""
    return info is not None and info.live and info.holder_alive is not False


def _waiting_label(waiting: int) -> str:
    """``3 waiting``: the line of blocked acquirers, the first sign of contention."""
    if not waiting:
        return ""
    return ngettext("%(count)d waiting", "%(count)d waiting", waiting) % {"count": waiting}


def key_segment(key: str) -> str:
    """A key as one URL path segment, as ``reverse()`` would write it for the admin.

    The admin's ``quote()`` escapes ``/``, ``_``, ``:`` and the like; the rest is percent-
    encoded like ``reverse()`` does, and the dot segments ``.`` and ``..`` are escaped so
    that browsers do not resolve them. Building it without ``reverse()`` keeps a page of a
    hundred rows from resolving two hundred URLs.
    """
    segment = url_quote(quote(key), safe=RFC3986_SUBDELIMS + "/~:@")
    return segment.replace(".", "%2E") if segment in {".", ".."} else segment


def _kind_label(info: LockInfo) -> str:
    """Shared (n of limit), group member, or elected leader; empty for a plain lock."""
    if info.shared:
        if info.limit:
            return _("semaphore %(count)s/%(limit)s") % {
                "count": len(info.live_holders),
                "limit": info.limit,
            }
        return _("shared")
    if info.kind == "election":
        return _("leader")
    if info.group:
        return _("group %(id)s") % {"id": info.group}
    return ""


def split_owner(owner: str) -> tuple[str, str | None]:
    """``host:pid:random`` as (host, pid); an owner of another shape is returned whole."""
    parts = owner.rsplit(":", 2)
    if len(parts) == 3 and parts[0] and parts[1].isdigit():
        return parts[0], parts[1]
    return owner, None


@dataclass(frozen=True, slots=True)
class LockRow:
    """One lock as the list and detail pages show it."""

    info: LockInfo
    url: str
    release_url: str
    selection: str
    select_label: str
    host: str
    pid: str | None
    """None when the owner is not ``host:pid:random``."""
    pid_label: str | None
    owner_link: str
    status: Literal["live", "expiring", "expired"]
    """The state, with live locks that end within ``expiring_within`` set apart."""
    status_label: str
    acquired: Moment
    refreshed: Moment
    expires: Moment
    lease: str
    kind_label: str = ""
    """What kind of lock: shared (with its limit), a group member, or an elected leader."""
    process: Literal["alive", "silent", "unknown"] = "unknown"
    """Whether the holder's process sends heartbeats (``LockInfo.holder_alive``)."""
    process_label: str = ""
    waiting_label: str = ""
    """How many acquirers wait in line for the key; empty when none do."""


# -- the request's list parameters --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListParams:
    """The changelist's filters, search, order, page and refresh, read leniently from GET.

    Unknown values fall back to the defaults instead of failing: these arrive from links
    and bookmarks, and a stale one should still show a useful page.
    """

    state: State = "all"
    prefix: str = ""
    owner: str = ""
    order: Order = "key"
    page: str | None = None
    refresh: int | None = None

    @classmethod
    def from_query(cls, query: Mapping[str, str], refresh_choices: Sequence[int]) -> ListParams:
        state = query.get(STATE_VAR, "")
        order = query.get(ORDER_VAR, "")
        refresh = query.get(REFRESH_VAR, "")
        return cls(
            state="live" if state == "live" else "expired" if state == "expired" else "all",
            prefix=query.get(SEARCH_VAR, "").strip(),
            owner=query.get(OWNER_VAR, "").strip(),
            order=_order(order),
            page=query.get(PAGE_VAR) or None,
            refresh=int(refresh) if refresh.isdigit() and int(refresh) in refresh_choices else None,
        )

    def as_query(self) -> dict[str, str]:
        """The non-default parameters, as a link would carry them."""
        query = {
            STATE_VAR: "" if self.state == "all" else self.state,
            SEARCH_VAR: self.prefix,
            OWNER_VAR: self.owner,
            ORDER_VAR: "" if self.order == "key" else self.order,
            PAGE_VAR: self.page or "",
            REFRESH_VAR: str(self.refresh or ""),
        }
        return {name: value for name, value in query.items() if value}

    def link(self, **changes: str | int | None) -> str:
        """A query string of these parameters with ``changes`` (None or "" drops one)."""
        query: dict[str, Any] = self.as_query()
        for name, value in changes.items():
            if value is None or value == "":
                query.pop(name, None)
            else:
                query[name] = value
        return "?" + urlencode(sorted(query.items()))

    @property
    def filtered(self) -> bool:
        return self.state != "all" or bool(self.prefix) or bool(self.owner)


def _order(value: str) -> Order:
    return cast(Order, value) if value in _ORDERS else "key"


_TOKEN = re.compile(r"-?[0-9]{1,20}")


def _token(value: object) -> int | None:
    """A fencing token from a form field; None unless an ASCII whole number within int64."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value.strip()):
        return None
    token = int(value)
    return token if -(2**63) <= token < 2**63 else None


def parse_selection(values: Sequence[str]) -> list[Selection]:
    """Checkbox values ``token:key`` as (key, token); malformed ones are dropped.

    The token goes first because a key may contain any character, ``:`` included.
    """
    picked: dict[str, int] = {}
    for value in values:
        raw_token, sep, key = value.partition(":")
        token = _token(raw_token)
        if not sep or token is None:
            continue
        try:
            validate_key(key)
        except (TypeError, ValueError):
            continue
        picked.setdefault(key, token)
    return list(picked.items())


# -- the admin -----------------------------------------------------------------------------------


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Lock]
else:  # ModelAdmin is generic for type checkers only
    _ModelAdmin = admin.ModelAdmin


@admin.register(Lock)
class LockAdmin(_ModelAdmin):
    """Lists, shows and force-releases the locks of the default ``LockManager``.

    Override ``get_manager`` to show another collection. Views check the model permissions
    themselves: ``view_lock`` (or ``release_lock``) to look, ``release_lock`` to release.
    """

    list_per_page = 100
    expiring_within = 10.0
    """Seconds: a live lock with less left than this counts, and is shown, as expiring."""
    refresh_choices: Sequence[int] = (5, 15, 60)
    """Auto-refresh periods (seconds) offered on the list page."""
    change_list_template = "admin/django_mongolock/lock/change_list.html"
    change_form_template = "admin/django_mongolock/lock/change_form.html"
    release_confirmation_template = "admin/django_mongolock/lock/release_confirmation.html"
    audit_entries = 50
    """How many force releases of a key its page shows (newest first)."""
    unavailable_template = "admin/django_mongolock/lock/unavailable.html"
    actions = None

    def get_manager(self) -> LockManager:
        """The manager whose collection this admin shows."""
        return get_manager()

    # -- permissions --------------------------------------------------------------------------

    def has_view_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        return self.has_release_permission(request) or request.user.has_perm(
            f"{self.opts.app_label}.view_lock"
        )

    def has_release_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.release_lock")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        return False

    # -- URLs ---------------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("", self._wrap(self.changelist_view), name=f"{prefix}_changelist"),
            path(
                "<path:object_id>/release/",
                self._wrap(self.release_view),
                name=f"{prefix}_release",
            ),
            path(
                "<path:object_id>/change/",
                self._wrap(self.change_view),
                name=f"{prefix}_change",
            ),
            # Like the admin's own: a bare object URL leads to its page.
            path(
                "<path:object_id>/",
                self._wrap(
                    RedirectView.as_view(pattern_name=f"{self.admin_site.name}:{prefix}_change")
                ),
            ),
        ]

    def _wrap(self, view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
        """``admin_view`` (staff only, CSRF, never cached), and a 503 page when MongoDB fails."""

        def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            try:
                return view(request, *args, **kwargs)
            except MongoLockError as exc:
                logger.warning("lock admin: %s", exc)
                return self.unavailable_view(request, error=exc)

        wrapper = self.admin_site.admin_view(update_wrapper(guarded, view))
        wrapper.model_admin = self  # type: ignore[attr-defined]
        return wrapper

    def _changelist_url(self, query: str = "") -> str:
        url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist",
            current_app=self.admin_site.name,
        )
        return f"{url}?{query}" if query else url

    def _lock_url(self, name: Literal["change", "release"], key: str, base: str = "") -> str:
        """The URL of one lock's page: ``base`` (the list's URL) + the quoted key + ``name``."""
        return f"{base or self._changelist_url()}{key_segment(key)}/{name}/"

    def _key(self, object_id: str) -> str:
        key = unquote(object_id)
        try:
            return validate_key(key)
        except (TypeError, ValueError) as exc:
            raise Http404(str(exc)) from exc

    def _context(self, request: HttpRequest, **context: Any) -> dict[str, Any]:
        manager = self.get_manager()
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "collection": f"{manager.database}.{manager.collection}",
            "has_view_permission": self.has_view_permission(request),
            "can_release": self.has_release_permission(request),
            "expiring_within": _duration(self.expiring_within),
            **context,
        }

    def _render(
        self, request: HttpRequest, template: str, context: dict[str, Any], status: int = 200
    ) -> TemplateResponse:
        request.current_app = self.admin_site.name
        return TemplateResponse(request, template, context, status=status)

    # -- rows -----------------------------------------------------------------------------------

    def _row(
        self,
        info: LockInfo,
        *,
        base: str = "",
        preserved: str = "",
        params: ListParams | None = None,
    ) -> LockRow:
        """The displayed form of one lock; ``base`` and ``preserved`` come from the list."""
        base = base or self._changelist_url()
        host, pid = split_owner(info.owner) if info.owner else (info.holder_label, None)
        status: Literal["live", "expiring", "expired"]
        if not info.live:
            status = "expired"
        elif info.remaining <= self.expiring_within:
            status = "expiring"  # still live: only shown in warning colours
        else:
            status = "live"
        release_query = f"token={info.token}" + (f"&{preserved}" if preserved else "")
        process, process_label = _process(info)
        return LockRow(
            info=info,
            url=self._lock_url("change", info.key, base) + (f"?{preserved}" if preserved else ""),
            release_url=f"{self._lock_url('release', info.key, base)}?{release_query}",
            selection=f"{info.token}:{info.key}",
            select_label=_("Select lock %(key)s") % {"key": info.key},
            host=host,
            pid=pid,
            pid_label=_("pid %(pid)s") % {"pid": pid} if pid is not None else None,
            owner_link=(params or ListParams()).link(
                **{OWNER_VAR: f"{host}:{pid}:" if pid is not None else info.owner, PAGE_VAR: None}
            )
            if info.owner
            else "",
            status=status,
            status_label=_("live") if info.live else _("expired"),
            acquired=Moment.of(info.acquired_at, info.now),
            refreshed=Moment.of(info.refreshed_at, info.now),
            expires=Moment.of(info.expires_at, info.now),
            lease=_duration(info.ttl),
            kind_label=_kind_label(info),
            process=process,
            process_label=process_label,
            waiting_label=_waiting_label(info.waiting),
        )

    # -- the list -------------------------------------------------------------------------------

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Counts, filters, search, sorting and one page of locks, all computed by MongoDB."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            return self._changelist_action(request)
        manager = self.get_manager()
        if manager.server_kind() == "standalone":
            # Reads work on a standalone mongod, but no lock can be taken there: say so.
            return self.unavailable_view(request, error=ReplicaSetRequired(manager.store.servers()))
        indexes = manager.check_indexes()
        missing = [item for item in indexes if item.action == "missing"]
        if missing:
            return self.unavailable_view(request, missing=missing)
        params = ListParams.from_query(request.GET, self.refresh_choices)
        counts = manager.counts(soon=self.expiring_within)
        total = counts["live"] + counts["expired"]
        prefix, owner = params.prefix or None, params.owner or None
        if prefix or owner:
            matching = manager.count(params.state, prefix, owner)
        else:  # the counts already say it: one round trip less
            matching = total if params.state == "all" else counts[params.state]
        # Paging over a range of positions: the documents of one page are fetched by the
        # server with skip/limit, never the whole collection.
        paginator = Paginator(range(matching), self.list_per_page)
        page = paginator.get_page(params.page)
        positions = page.object_list
        assert isinstance(positions, range)
        locks = (
            manager.list(
                params.state,
                prefix,
                owner=owner,
                limit=len(positions),
                offset=positions.start,
                order=params.order,
            )
            if len(positions)
            else []
        )
        query = params.as_query()
        preserved = urlencode({"_changelist_filters": urlencode(sorted(query.items()))})
        base = self._changelist_url()
        rows = [
            self._row(info, base=base, preserved=preserved if query else "", params=params)
            for info in locks
        ]
        context = self._context(
            request,
            title=capfirst(str(self.opts.verbose_name_plural)),
            params=params,
            rows=rows,
            counts=counts,
            total=total,
            matching=matching,
            server_time=_absolute(locks[0].now) if locks else None,
            paginator=paginator,
            page=page,
            page_links=self._page_links(params, paginator, page.number),
            headers=self._headers(params),
            state_choices=self._state_choices(params),
            refresh_links=self._refresh_links(params),
            links={
                "clear": params.link(
                    **{STATE_VAR: None, SEARCH_VAR: None, OWNER_VAR: None, PAGE_VAR: None}
                ),
                "live": params.link(**{STATE_VAR: "live", PAGE_VAR: None}),
                "expired": params.link(**{STATE_VAR: "expired", PAGE_VAR: None}),
                "expiring": params.link(
                    **{STATE_VAR: "live", ORDER_VAR: "expires", PAGE_VAR: None}
                ),
            },
            index_warnings=[item for item in indexes if item.action == "differs"],
            release_action=RELEASE_ACTION,
            action_checkbox_name=ACTION_CHECKBOX_NAME,
            **(extra_context or {}),
        )
        return self._render(request, self.change_list_template, context)

    def _page_links(
        self, params: ListParams, paginator: Paginator[int], number: int
    ) -> list[tuple[int | str, str | None]]:
        """(label, link) per paginator entry; no link for the current page or an ellipsis."""
        if paginator.num_pages <= 1:
            return []
        links: list[tuple[int | str, str | None]] = []
        for item in paginator.get_elided_page_range(number):
            if item == number or not isinstance(item, int):
                links.append((item, None))
            else:
                links.append((item, params.link(**{PAGE_VAR: item if item > 1 else None})))
        return links

    def _headers(self, params: ListParams) -> list[dict[str, Any]]:
        """Column headers; key, acquisition and expiry sort on the server (``o=``)."""
        columns: list[tuple[str, str, str | None]] = [
            ("key", _("key"), "key"),
            ("state", _("state"), None),
            ("owner", _("owner"), None),
            ("token", _("fencing token"), None),
            ("acquired", _("acquired"), "acquired"),
            ("expires", _("expires"), "expires"),
            ("lease", _("lease"), None),
        ]
        headers = []
        for name, label, field in columns:
            header: dict[str, Any] = {"name": name, "text": label, "sortable": field is not None}
            if field is not None:
                ascending = params.order == field
                descending = params.order == f"-{field}"
                header.update(
                    sorted=ascending or descending,
                    ascending=ascending,
                    url_primary=params.link(**{ORDER_VAR: f"-{field}" if ascending else field}),
                    url_toggle=params.link(**{ORDER_VAR: field if descending else f"-{field}"}),
                    url_remove=params.link(**{ORDER_VAR: None}),
                )
            headers.append(header)
        return headers

    def _state_choices(self, params: ListParams) -> list[dict[str, Any]]:
        choices: list[tuple[State, str]] = [
            ("all", _("All")),
            ("live", _("Live")),
            ("expired", _("Expired")),
        ]
        return [
            {
                "display": label,
                "selected": params.state == state,
                "link": params.link(
                    **{STATE_VAR: None if state == "all" else state, PAGE_VAR: None}
                ),
            }
            for state, label in choices
        ]

    def _refresh_links(self, params: ListParams) -> list[dict[str, Any]]:
        links = [
            {
                "display": _("off"),
                "selected": params.refresh is None,
                "link": params.link(**{REFRESH_VAR: None}),
            }
        ]
        for seconds in self.refresh_choices:
            links.append(
                {
                    "display": _duration(seconds),
                    "selected": params.refresh == seconds,
                    "link": params.link(**{REFRESH_VAR: seconds}),
                }
            )
        return links

    def _changelist_action(self, request: HttpRequest) -> HttpResponse:
        """The bulk action: confirm first, then release at the tokens the list showed."""
        if not self.has_release_permission(request):
            raise PermissionDenied
        back = HttpResponseRedirect(request.get_full_path())
        if request.POST.get("action") != RELEASE_ACTION:
            messages.warning(request, _("No action selected."))
            return back
        selection = parse_selection(request.POST.getlist(ACTION_CHECKBOX_NAME))
        if not selection:
            messages.warning(
                request,
                _(
                    "Items must be selected in order to perform actions on them. No items "
                    "have been changed."
                ),
            )
            return back
        if request.POST.get("post") == "yes":
            return self._release(
                request, selection, back, cancel_url=request.get_full_path(), bulk=True
            )
        return self._release_confirmation(
            request, selection, cancel_url=request.get_full_path(), bulk=True
        )

    # -- one lock -------------------------------------------------------------------------------

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """Every field of one lock, its release history, and the force-release button."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        key = self._key(object_id)
        preserved = self.get_preserved_filters(request)
        changelist_url = self._changelist_url(_changelist_filters(request))
        manager = self.get_manager()
        info = manager.status(key)
        audit = manager.history(key, limit=self.audit_entries)
        if info is None:
            if audit:  # the lock is gone, its force releases are not
                return self._history_only(request, key, audit, changelist_url)
            messages.warning(request, _(_MISSING) % {"key": key})
            return HttpResponseRedirect(changelist_url)
        row = self._row(info, preserved=preserved)
        content_type = ContentType.objects.get_for_model(self.model)
        history = (
            LogEntry.objects.filter(content_type=content_type, object_id=key)
            .select_related("user")
            .order_by("-action_time")[:10]
        )
        purge_at = info.expires_at + timedelta(seconds=self.get_manager().retention)
        context = self._context(
            request,
            title=_("Lock “%(key)s”") % {"key": _short(key)},
            row=row,
            info=info,
            server_time=_absolute(info.now),
            purge=Moment.of(purge_at, info.now),
            history=history,
            audit=_audit_rows(audit, info.now),
            holders=[
                {
                    "owner": holder.owner,
                    "token": holder.token,
                    "acquired": Moment.of(holder.acquired_at, info.now),
                    "expires": Moment.of(holder.expires_at, info.now),
                    "live": holder.expires_at > info.now,
                }
                for holder in info.holders
            ],
            changelist_url=changelist_url,
            **(extra_context or {}),
        )
        return self._render(request, self.change_form_template, context)

    def _history_only(
        self,
        request: HttpRequest,
        key: str,
        audit: Sequence[AuditEntry],
        changelist_url: str,
    ) -> HttpResponse:
        """The page of a key that is not held now but was force-released: its audit trail."""
        context = self._context(
            request,
            title=_("Lock “%(key)s”") % {"key": _short(key)},
            key=key,
            info=None,
            audit=_audit_rows(audit, None),
            changelist_url=changelist_url,
        )
        return self._render(request, self.change_form_template, context)

    def release_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Force release of one lock: a confirmation page on GET, the release on POST."""
        if not self.has_release_permission(request):
            raise PermissionDenied
        key = self._key(object_id)
        changelist_url = self._changelist_url(_changelist_filters(request))
        if request.method == "POST":
            token = _token(request.POST.get("token"))
            if token is None:
                messages.error(
                    request, _("Nothing was released: the request did not carry a fencing token.")
                )
                return HttpResponseRedirect(self._lock_url("change", key))
            return self._release(
                request,
                [(key, token)],
                HttpResponseRedirect(changelist_url),
                cancel_url=self._lock_url("change", key),
                bulk=False,
            )
        token = _token(request.GET.get("token"))
        if token is None:
            info = self.get_manager().status(key)
            if info is None:
                messages.warning(request, _(_MISSING) % {"key": key})
                return HttpResponseRedirect(changelist_url)
            token = info.token
        detail_url = self._lock_url("change", key)
        preserved = self.get_preserved_filters(request)
        return self._release_confirmation(
            request,
            [(key, token)],
            cancel_url=f"{detail_url}?{preserved}" if preserved else detail_url,
            bulk=False,
        )

    # -- releasing ------------------------------------------------------------------------------

    def _release_confirmation(
        self,
        request: HttpRequest,
        selection: Sequence[Selection],
        *,
        cancel_url: str,
        bulk: bool,
        unconfirmed: bool = False,
    ) -> HttpResponse:
        """What would be released, as the server sees it now; changed locks are left out.

        A live lock whose holder is not known to be dead gets a box to tick: the release of that
        lock goes ahead only with it ticked. ``unconfirmed``: shown again because a box
        was left unticked.
        """
        manager = self.get_manager()
        items = []
        for key, token in selection:
            current = manager.status(key)
            if current is None:
                outcome = "gone"
            elif current.token != token:
                outcome = "changed"
            else:
                outcome = "release"
            items.append(
                {
                    "key": key,
                    "token": token,
                    "selection": f"{token}:{key}",
                    "outcome": outcome,
                    "current": None if current is None else self._row(current),
                    "alive": outcome == "release" and _may_be_alive(current),
                }
            )
        releasable = [item for item in items if item["outcome"] == "release"]
        context = self._context(
            request,
            title=_("Are you sure?"),
            items=items,
            releasable=releasable,
            bulk=bulk,
            cancel_url=cancel_url,
            release_action=RELEASE_ACTION,
            action_checkbox_name=ACTION_CHECKBOX_NAME,
            changelist_url=self._changelist_url(_changelist_filters(request)),
            alive=[item for item in releasable if item["alive"]],
            unconfirmed=unconfirmed,
            confirm_alive_var=CONFIRM_ALIVE_VAR,
            reason_var=REASON_VAR,
            reason_max=REASON_MAX,
            reason=request.POST.get(REASON_VAR, "")[:REASON_MAX],
        )
        return self._render(request, self.release_confirmation_template, context)

    def _release(
        self,
        request: HttpRequest,
        selection: Sequence[Selection],
        done: HttpResponse,
        *,
        cancel_url: str,
        bulk: bool,
    ) -> HttpResponse:
        """Delete each lock only at the token the operator confirmed; log and report each.

        A live lock whose holder is not known to be dead is released only if its box was ticked;
        the others are shown for confirmation again. Each release is recorded in the
        audit trail with the user's name and the reason given.
        """
        manager = self.get_manager()
        confirmed = set(request.POST.getlist(CONFIRM_ALIVE_VAR))
        reason = request.POST.get(REASON_VAR, "").strip()[:REASON_MAX].replace("\x00", "")
        by = request.user.get_username() or str(request.user.pk)
        released: list[LockInfo] = []
        unconfirmed: list[Selection] = []
        for key, token in selection:
            current = manager.status(key)
            if (
                current is not None
                and current.token == token
                and _may_be_alive(current)
                and f"{token}:{key}" not in confirmed
            ):
                unconfirmed.append((key, token))
                continue
            info = manager.force_release(key, token=token, reason=reason, by=by)
            if info is not None:
                released.append(info)
                self.log_release(request, info)
                continue
            current = manager.status(key)
            if current is None:
                messages.warning(
                    request,
                    _("The lock “%(key)s” was not released: it no longer exists.") % {"key": key},
                )
            else:
                messages.warning(
                    request,
                    _(
                        "The lock “%(key)s” was not released: it changed hands since the page "
                        "was shown (fencing token %(token)s, now %(current)s held by %(owner)s)."
                    )
                    % {
                        "key": key,
                        "token": token,
                        "current": current.token,
                        "owner": current.owner,
                    },
                )
        if len(released) == 1:
            info = released[0]
            messages.success(
                request,
                _(
                    "The lock “%(key)s” was force-released (owner %(owner)s, fencing token "
                    "%(token)s)."
                )
                % {"key": info.key, "owner": info.owner, "token": info.token},
            )
        elif released:
            messages.success(
                request,
                ngettext(
                    "%(count)d lock was force-released.",
                    "%(count)d locks were force-released.",
                    len(released),
                )
                % {"count": len(released)},
            )
        if unconfirmed:
            messages.warning(
                request,
                ngettext(
                    "%(count)d lock was not released: the process holding it may be alive. "
                    "Tick the box to confirm.",
                    "%(count)d locks were not released: the processes holding them may be alive. "
                    "Tick a box for each to confirm.",
                    len(unconfirmed),
                )
                % {"count": len(unconfirmed)},
            )
            return self._release_confirmation(
                request, unconfirmed, cancel_url=cancel_url, bulk=bulk, unconfirmed=True
            )
        return done

    def log_release(self, request: HttpRequest, info: LockInfo) -> LogEntry:
        """Record a force release in the admin log: key, former owner and fencing token."""
        user_id = request.user.pk
        assert user_id is not None  # admin_view lets only staff users in
        return LogEntry.objects.create(
            user_id=user_id,
            content_type_id=ContentType.objects.get_for_model(self.model).pk,
            object_id=info.key,
            object_repr=_short(info.key, 200),
            action_flag=DELETION,
            change_message=f"Force-released; owner {info.owner}, fencing token {info.token}.",
        )

    # -- MongoDB trouble ------------------------------------------------------------------------

    def unavailable_view(
        self,
        request: HttpRequest,
        *,
        error: MongoLockError | None = None,
        missing: Sequence[IndexAction] = (),
    ) -> HttpResponse:
        """A 503 page that says what is wrong with MongoDB and what to do about it."""
        if isinstance(error, ServerUnavailable):
            problem = "unreachable"
        elif isinstance(error, ReplicaSetRequired):
            problem = "standalone"
        elif isinstance(error, ConfigurationError):
            problem = "configuration"
        elif error is not None:
            problem = "error"
        else:
            problem = "indexes"
        try:
            manager: LockManager | None = self.get_manager()
        except MongoLockError:
            manager = None
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "title": _("MongoDB locks are unavailable"),
            "problem": problem,
            "error": error,
            "missing": missing,
            "collection": f"{manager.database}.{manager.collection}" if manager else None,
        }
        return self._render(request, self.unavailable_template, context, status=503)


def _audit_rows(entries: Sequence[AuditEntry], now: datetime | None) -> list[dict[str, Any]]:
    """Audit entries as the key's page shows them (relative to the server's ``now``)."""
    return [
        {
            "entry": entry,
            "at": Moment.of(entry.at, now) if now is not None else None,
            "absolute": _absolute(entry.at),
            "iso": entry.at.astimezone(UTC).isoformat(),
        }
        for entry in entries
    ]


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _changelist_filters(request: HttpRequest) -> str:
    """The list's query string, carried along by the detail and release pages."""
    return request.GET.get("_changelist_filters", "")
