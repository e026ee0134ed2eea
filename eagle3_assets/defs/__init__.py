"""What the UI shows: one module per asset (with its checks, from core's gates), and the jobs.

An asset module is a thin wrapper over ``core/``: it reads its config and
resources, calls the core, and turns the result into files, metadata and check
results. The sensors are the top-level ``sensors/`` package, the resources
``resources/``; ``eagle3_assets.graph`` puts them together.
"""
