"""Driving the Dagster instance from outside it: backfills of chosen shards."""
