"""The benchmark suite: django-mongolock against a raw-driver floor and python-redis-lock.

Run it with ``make bench`` (or ``python benchmarks/run.py --help``). Every workload runs the
locks under test side by side, in interleaved rounds, against the same servers.
"""
