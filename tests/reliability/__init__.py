"""Fault tests against real mongod processes: failover, crashes, clock skew, outages, pauses, load.

Run by ``make test-reliability`` (``pytest tests/reliability``); the main suite leaves them out.
"""
