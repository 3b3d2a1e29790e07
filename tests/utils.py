"""Helpers for running management commands in tests."""

from __future__ import annotations

from io import StringIO
from typing import Any

from django.core.management import CommandError, call_command


def run_command(*args: str, **options: Any) -> tuple[str, str, int]:
    """Run a management command; return (stdout, stderr, exit code) like a shell would."""
    out, err = StringIO(), StringIO()
    try:
        call_command(*args, stdout=out, stderr=err, no_color=True, **options)
    except CommandError as exc:
        err.write(str(exc))
        return out.getvalue(), err.getvalue(), exc.returncode
    return out.getvalue(), err.getvalue(), 0
