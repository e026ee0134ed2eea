"""The Dagster glue the assets share, none of it an asset: partitions, shard runs and their status, lineage,
run launching, stage configs, capacity facts and the adapter from core's gate tables to asset checks.
"""
