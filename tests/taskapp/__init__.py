"""Task functions run by real ``db_worker`` processes (tests/test_django_tasks_db.py)."""
