"""Sensors: gate-failure and run-failure alerts, server health, new prompt shards."""
