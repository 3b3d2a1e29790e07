"""Enqueue tasks and read their results as a process with the worker settings.

``python -m tests.taskapp.driver`` with ``DJANGO_SETTINGS_MODULE=tests.tasks_settings``:
the results live in the workers' SQL database, which the test process (on the suite's
settings) does not use. One JSON request per line on stdin, one JSON answer per line:

- ``{"enqueue": NAME, "kwargs": {...}}``: ``tasks.NAME.enqueue(**kwargs)``; ``{"id": ID}``;
- ``{"result": ID}``: the result as the default backend reads it: ``status``,
  ``return_value`` (when SUCCESSFUL), ``errors`` (exception class paths) and ``worker_ids``.

A request that raises is answered ``{"error": "..."}``; end of input ends the driver.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.tasks_settings")
    import django

    django.setup()
    from tests.taskapp import tasks

    backend: Any = importlib.import_module("django.tasks").default_task_backend

    def answer(request: dict[str, Any]) -> dict[str, Any]:
        if "enqueue" in request:
            result = getattr(tasks, request["enqueue"]).enqueue(**request.get("kwargs", {}))
            return {"id": str(result.id)}
        result = backend.get_result(request["result"])
        status = str(result.status)
        return {
            "status": status,
            "return_value": result.return_value if status == "SUCCESSFUL" else None,
            "errors": [error.exception_class_path for error in result.errors],
            "worker_ids": list(result.worker_ids),
        }

    for line in sys.stdin:
        try:
            reply = answer(json.loads(line))
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
