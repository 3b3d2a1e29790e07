"""Demo views: rendering one invoice at a time, whichever server the request reaches."""

from __future__ import annotations

import time

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

from django_mongolock import current_lock, locked

MAX_SECONDS = 30.0


@locked("invoice-{pk}")
def render_invoice(request: HttpRequest, pk: int) -> HttpResponse:
    """Render invoice ``pk``; a second request for it meanwhile gets 423 Locked.

    ``?seconds=N`` (at most 30) makes the rendering slow enough to try that by hand.
    """
    try:
        seconds = float(request.GET.get("seconds", "0"))
    except ValueError:
        return HttpResponseBadRequest("seconds must be a number\n")
    if not 0 <= seconds <= MAX_SECONDS:
        return HttpResponseBadRequest(f"seconds must be from 0 to {MAX_SECONDS:g}\n")
    lock = current_lock()
    assert lock is not None  # @locked holds it while the view runs
    time.sleep(seconds)
    return HttpResponse(
        f"invoice {pk} rendered under lock {lock.key!r}, fencing token {lock.token}\n",
        content_type="text/plain; charset=utf-8",
    )
