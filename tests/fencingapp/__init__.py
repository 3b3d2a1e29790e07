"""Models of the fenced-write tests: rows that a fencing token protects."""
