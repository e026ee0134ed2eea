"""Dagster-free logic: every function here is importable and testable without an instance."""
