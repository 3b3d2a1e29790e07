"""Optional integrations built on ``events``: Prometheus metrics, OpenTelemetry traces.

Each needs its extra (``django-mongolock[prometheus]``, ``django-mongolock[otel]``) and
costs nothing until it is installed.
"""
