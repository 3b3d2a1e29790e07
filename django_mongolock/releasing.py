"""Force release from the admin: what the confirmation page lists, and the release itself.

A lock is deleted only at the fencing token the operator saw, so a lock that changed hands
in between is left to its new holder. A lock whose holder's process may be alive is
released only once the operator has ticked a box saying they know; every force release
is recorded in the audit trail with the user's name and reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Final

from django.contrib import messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.http import HttpRequest, HttpResponse
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_mongolock.display import may_be_alive, short
from django_mongolock.info import LockInfo
from django_mongolock.manager import LockManager
from django_mongolock.models import Lock
from django_mongolock.validation import validate_key

__all__ = [
    "CONFIRM_ALIVE_VAR",
    "REASON_MAX",
    "REASON_VAR",
    "RELEASE_ACTION",
    "ReleaseViews",
    "Selection",
    "bulk_selection",
    "confirmation_context",
    "confirmation_items",
    "force_release",
    "parse_selection",
    "parse_token",
]

RELEASE_ACTION: Final = "release_selected"
CONFIRM_ALIVE_VAR: Final = "confirm_alive"
REASON_VAR: Final = "reason"
REASON_MAX: Final = 1000

Selection = tuple[str, int]
"""A lock the operator picked: its key and the fencing token the page showed."""


_TOKEN = re.compile(r"-?[0-9]{1,20}")


def parse_token(value: object) -> int | None:
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
        token = parse_token(raw_token)
        if not sep or token is None:
            continue
        try:
            validate_key(key)
        except (TypeError, ValueError):
            continue
        picked.setdefault(key, token)
    return list(picked.items())


def bulk_selection(request: HttpRequest) -> list[Selection]:
    """The locks the list's bulk action picked; empty, with a message saying why, when the
    action is not the release or nothing valid was ticked."""
    if request.POST.get("action") != RELEASE_ACTION:
        messages.warning(request, _("No action selected."))
        return []
    selection = parse_selection(request.POST.getlist(ACTION_CHECKBOX_NAME))
    if not selection:
        messages.warning(
            request,
            _(
                "Items must be selected in order to perform actions on them. No items "
                "have been changed."
            ),
        )
    return selection


def confirmation_items(
    manager: LockManager, selection: Sequence[Selection], row: Callable[[LockInfo], Any]
) -> list[dict[str, Any]]:
    """What would be released, as the server sees it now: each picked lock with its
    outcome (``release``, ``changed`` hands, ``gone``), its current ``row``, and whether
    the release needs the box ticked (``alive``)."""
    now = manager.statuses(key for key, _ in selection)  # two queries for the whole page
    items = []
    for key, token in selection:
        current = now.get(key)
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
                "current": None if current is None else row(current),
                "alive": outcome == "release" and may_be_alive(current),
            }
        )
    return items


def confirmation_context(
    request: HttpRequest,
    manager: LockManager,
    selection: Sequence[Selection],
    row: Callable[[LockInfo], Any],
) -> dict[str, Any]:
    """What the confirmation page shows: the picked locks as the server sees them now (those
    that changed hands are left out) and the boxes to tick for holders that may be alive."""
    items = confirmation_items(manager, selection, row)
    releasable = [item for item in items if item["outcome"] == "release"]
    return {
        "title": _("Are you sure?"),
        "items": items,
        "releasable": releasable,
        "alive": [item for item in releasable if item["alive"]],
        "release_action": RELEASE_ACTION,
        "action_checkbox_name": ACTION_CHECKBOX_NAME,
        "confirm_alive_var": CONFIRM_ALIVE_VAR,
        "reason_var": REASON_VAR,
        "reason_max": REASON_MAX,
        "reason": request.POST.get(REASON_VAR, "")[:REASON_MAX],
    }


def force_release(
    request: HttpRequest,
    manager: LockManager,
    selection: Sequence[Selection],
    log: Callable[[LockInfo], object],
) -> list[Selection]:
    """Delete each lock only at the token the operator confirmed; ``log`` and report each.

    A live lock whose holder is not known to be dead is released only if its box was
    ticked: those left unreleased are returned, for the confirmation page again. Each
    release is recorded in the audit trail with the user's name and the reason given.
    """
    confirmed = set(request.POST.getlist(CONFIRM_ALIVE_VAR))
    reason = request.POST.get(REASON_VAR, "").strip()[:REASON_MAX].replace("\x00", "")
    by = request.user.get_username() or str(request.user.pk)
    before = manager.statuses(key for key, _ in selection)
    unconfirmed: list[Selection] = []
    chosen: list[Selection] = []
    for key, token in selection:
        current = before.get(key)
        if (
            current is not None
            and current.token == token
            and may_be_alive(current)
            and f"{token}:{key}" not in confirmed
        ):
            unconfirmed.append((key, token))
        else:
            chosen.append((key, token))
    # A few round trips for the whole selection, not a few for each lock; each logged as
    # its transaction commits, so that those released before an error are logged too.
    released = manager.force_release_many(chosen, reason=reason, by=by, on_released=log)
    done = {info.key for info in released}
    missed = [key for key, _ in chosen if key not in done]
    after = manager.statuses(missed) if missed else {}
    for key, token in chosen:
        if key in done:
            continue
        current = after.get(key)
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
            _("The lock “%(key)s” was force-released (owner %(owner)s, fencing token %(token)s).")
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
    return unconfirmed


class ReleaseViews:
    """The confirmation page and the release, as ``LockAdmin`` shows and runs them (a base
    class of it: what it needs of the admin is declared here and defined there)."""

    model: type[Lock]
    release_confirmation_template: str

    def get_manager(self) -> LockManager:
        raise NotImplementedError

    def _context(self, request: HttpRequest, **context: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _render(
        self, request: HttpRequest, template: str, context: dict[str, Any], status: int = 200
    ) -> HttpResponse:
        raise NotImplementedError

    def _row(self, info: LockInfo, *, preserved: str = "") -> Any:
        raise NotImplementedError

    def _changelist_url(self, query: str = "") -> str:
        raise NotImplementedError

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
        context = self._context(
            request,
            **confirmation_context(request, self.get_manager(), selection, self._row),
            bulk=bulk,
            cancel_url=cancel_url,
            changelist_url=self._changelist_url(request.GET.get("_changelist_filters", "")),
            unconfirmed=unconfirmed,
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
        """Release at the tokens the operator confirmed; ask again for the unticked boxes."""
        unconfirmed = force_release(
            request, self.get_manager(), selection, lambda info: self.log_release(request, info)
        )
        if unconfirmed:
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
            object_repr=short(info.key, 200),
            action_flag=DELETION,
            change_message=f"Force-released; owner {info.owner}, fencing token {info.token}.",
        )
