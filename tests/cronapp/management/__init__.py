"""Management commands of the cron tests."""
