"""Imported at start-up by the Dagster processes a test starts with this directory on PYTHONPATH.

Dagster's backfill daemon wakes every 30 seconds, a constant with no setting
(``dagster._daemon.controller.DEFAULT_DAEMON_INTERVAL_SECONDS``). A backfill of
``prompts -> raw_responses -> validated_traces`` is submitted one asset level
per wake-up (their backfill policies differ), so a three-shard backfill spent
about 90 of its 127 seconds waiting on that clock in the UI test. With
``EAGLE3_TEST_DAEMON_TICK_S`` set, this module sets the constant as the
module is first imported; everything else the daemon does is Dagster's own.
Nothing of the product imports it.
"""

import os
import sys

_TICK_S = os.environ.get("EAGLE3_TEST_DAEMON_TICK_S")

if _TICK_S:
    import importlib.abc
    import importlib.machinery

    class _DaemonTick(importlib.abc.MetaPathFinder):
        """Finds ``dagster._daemon.controller`` as Python would, and sets its interval once it has run."""

        def find_spec(self, name, path=None, target=None):
            if name != "dagster._daemon.controller":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                module.DEFAULT_DAEMON_INTERVAL_SECONDS = float(_TICK_S)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _DaemonTick())
