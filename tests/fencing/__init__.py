"""Fenced writes on SQLite, PostgreSQL and MongoDB."""
