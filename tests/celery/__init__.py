"""Real Celery workers on kombu's MongoDB transport, started as processes by the tests."""
