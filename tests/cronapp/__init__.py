"""Management commands that cron starts on many hosts at once (tests/test_cron.py)."""
