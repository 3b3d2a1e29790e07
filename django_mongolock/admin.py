"""The admin dashboard of live and expired locks, read straight from the MongoDB collection.

The ``Lock`` model has no table: it lends the admin its sidebar entry, URLs and permissions
(``view_lock``, ``release_lock``). ``LockAdmin`` holds the views; what they show comes from
``dashboard`` (the list's queries and rows, like Django's ``ChangeList``), ``releasing``
(force release at the fencing token the operator saw), ``health`` (the server check and
the 503 page) and ``display`` (times, holders and kinds, as the pages word them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import update_wrapper
from typing import TYPE_CHECKING, Any, Final, Literal

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import unquote
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.text import capfirst
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop
from django.views.generic import RedirectView

from django_mongolock.conf import apply_stats_setting, get_manager
from django_mongolock.contention import contention_context, key_context
from django_mongolock.dashboard import (
    ListParams,
    LockList,
    LockRow,
    lock_row,
    lock_url,
)
from django_mongolock.display import audit_rows, detail_context, duration, short
from django_mongolock.exceptions import MongoLockError
from django_mongolock.health import HealthCheck, unavailable_context
from django_mongolock.info import IndexAction, LockInfo
from django_mongolock.manager import LockManager
from django_mongolock.models import Lock
from django_mongolock.releasing import (
    RELEASE_ACTION,
    ReleaseViews,
    bulk_selection,
    parse_token,
)
from django_mongolock.validation import validate_key

__all__ = ["LockAdmin"]

logger = logging.getLogger("django_mongolock.admin")

# The contention view counts what this process's locks see: record it in every process
# that loads the admin (workers included, through admin autodiscovery), unless
# MONGOLOCK['STATS'] is False. No I/O, no thread.
apply_stats_setting()

_MISSING: Final = gettext_noop(
    "The lock “%(key)s” does not exist: it was released, or purged after it expired."
)


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Lock]
else:  # ModelAdmin is generic for type checkers only
    _ModelAdmin = admin.ModelAdmin


@admin.register(Lock)
class LockAdmin(ReleaseViews, _ModelAdmin):
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
    contention_template = "admin/django_mongolock/lock/contention.html"
    contention_keys = 10
    """How many of the busiest keys the contention view shows."""
    actions = None
    health_check_interval = 30.0
    """Seconds a passed check of the server (a replica set, every index in place) is trusted
    before the list page checks again; a failed check is never trusted."""

    def __init__(self, model: type[Lock], admin_site: admin.AdminSite) -> None:
        super().__init__(model, admin_site)
        self.health_check = HealthCheck()

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
            path("contention/", self._wrap(self.contention_view), name=f"{prefix}_contention"),
            path(
                "<path:object_id>/release/", self._wrap(self.release_view), name=f"{prefix}_release"
            ),
            path("<path:object_id>/change/", self._wrap(self.change_view), name=f"{prefix}_change"),
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

    def _lock_url(self, name: Literal["change", "release"], key: str) -> str:
        return lock_url(self._changelist_url(), name, key)

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
            "expiring_within": duration(self.expiring_within),
            **context,
        }

    def _render(
        self, request: HttpRequest, template: str, context: dict[str, Any], status: int = 200
    ) -> TemplateResponse:
        request.current_app = self.admin_site.name
        return TemplateResponse(request, template, context, status=status)

    def _row(self, info: LockInfo, *, preserved: str = "") -> LockRow:
        """The displayed form of one lock, for the detail and confirmation pages."""
        return lock_row(
            info,
            base=self._changelist_url(),
            expiring_within=self.expiring_within,
            preserved=preserved,
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
        health = self.health_check(manager, self.health_check_interval)
        if health.error is not None:
            return self.unavailable_view(request, error=health.error)
        if health.missing:
            return self.unavailable_view(request, missing=health.missing)
        listing = LockList(
            manager,
            ListParams.from_query(request.GET, self.refresh_choices),
            base=self._changelist_url(),
            per_page=self.list_per_page,
            expiring_within=self.expiring_within,
            refresh_choices=self.refresh_choices,
        )
        context = self._context(
            request,
            title=capfirst(str(self.opts.verbose_name_plural)),
            **listing.context(),
            index_warnings=health.warnings,
            release_action=RELEASE_ACTION,
            action_checkbox_name=ACTION_CHECKBOX_NAME,
            **(extra_context or {}),
        )
        return self._render(request, self.change_list_template, context)

    def _changelist_action(self, request: HttpRequest) -> HttpResponse:
        """The bulk action: confirm first, then release at the tokens the list showed."""
        if not self.has_release_permission(request):
            raise PermissionDenied
        back = HttpResponseRedirect(request.get_full_path())
        selection = bulk_selection(request)
        if not selection:
            return back
        if request.POST.get("post") == "yes":
            return self._release(
                request, selection, back, cancel_url=request.get_full_path(), bulk=True
            )
        return self._release_confirmation(
            request, selection, cancel_url=request.get_full_path(), bulk=True
        )

    def contention_view(self, request: HttpRequest) -> HttpResponse:
        """The last hour: charts and a table of acquisitions, waits and losses, the busiest
        keys, and the longest lines of waiters now."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = self._context(
            request,
            title=_("Lock contention"),
            changelist_url=self._changelist_url(),
            **contention_context(
                self.get_manager(),
                url=lambda key: self._lock_url("change", key),
                limit=self.contention_keys,
            ),
        )
        return self._render(request, self.contention_template, context)

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
        if info is None and not audit:
            messages.warning(request, _(_MISSING) % {"key": key})
            return HttpResponseRedirect(changelist_url)
        if info is None:  # the lock is gone, its force releases are not: show those
            context = self._context(
                request,
                title=_("Lock “%(key)s”") % {"key": short(key)},
                key=key,
                info=None,
                audit=audit_rows(audit, None),
                changelist_url=changelist_url,
                **key_context(manager, key, audit),
            )
            return self._render(request, self.change_form_template, context)
        row = self._row(info, preserved=preserved)
        content_type = ContentType.objects.get_for_model(self.model)
        history = (
            LogEntry.objects.filter(content_type=content_type, object_id=key)
            .select_related("user")
            .order_by("-action_time")[:10]
        )
        context = self._context(
            request,
            title=_("Lock “%(key)s”") % {"key": short(key)},
            row=row,
            **detail_context(info, audit, retention=manager.retention),
            history=history,
            changelist_url=changelist_url,
            **key_context(manager, key, audit),
            **(extra_context or {}),
        )
        return self._render(request, self.change_form_template, context)

    def release_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Force release of one lock: a confirmation page on GET, the release on POST."""
        if not self.has_release_permission(request):
            raise PermissionDenied
        key = self._key(object_id)
        changelist_url = self._changelist_url(_changelist_filters(request))
        if request.method == "POST":
            token = parse_token(request.POST.get("token"))
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
        token = parse_token(request.GET.get("token"))
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

    # -- MongoDB trouble ------------------------------------------------------------------------

    def unavailable_view(
        self,
        request: HttpRequest,
        *,
        error: MongoLockError | None = None,
        missing: Sequence[IndexAction] = (),
    ) -> HttpResponse:
        """A 503 page that says what is wrong with MongoDB and what to do about it."""
        try:
            manager: LockManager | None = self.get_manager()
        except MongoLockError:
            manager = None
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            **unavailable_context(manager, error, missing),
        }
        return self._render(request, self.unavailable_template, context, status=503)


def _changelist_filters(request: HttpRequest) -> str:
    """The list's query string, carried along by the detail and release pages."""
    return request.GET.get("_changelist_filters", "")
