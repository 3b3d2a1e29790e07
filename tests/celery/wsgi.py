"""The demo project as gunicorn serves it with ``--preload``, holding a lock before forking.

The master imports this module once: it builds the WSGI application and takes the lock
``MONGOLOCK_PARENT_KEY`` (opening a client and starting a refresher) before gunicorn forks
its workers, which must build their own and leave the master's lock alone.
"""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.celery.settings")
application = get_wsgi_application()

from django_mongolock import locks  # noqa: E402

PARENT_LOCK = locks.acquire(os.environ["MONGOLOCK_PARENT_KEY"])
print(f"parent {os.getpid()} holds {PARENT_LOCK.key} with token {PARENT_LOCK.token}", flush=True)
