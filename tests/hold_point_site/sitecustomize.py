"""Fault injection for tests (tests/hold_point.py): hold this process at a named call of the product.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry
that has one; a test that starts a process with this directory first on
``PYTHONPATH`` and ``EAGLE3_TEST_HOLD_AT`` set gets that process (and every
Python process it starts, which inherit both) patched as follows. Without
``EAGLE3_TEST_HOLD_AT`` nothing happens.

``EAGLE3_TEST_HOLD_AT=module:Qualified.name``: when ``module`` is imported, that
function (or method) is wrapped. Its ``EAGLE3_TEST_HOLD_CALL``-th call (1 by
default) counting only calls with an argument (a ``str`` or a path) that contains
``EAGLE3_TEST_HOLD_MATCH`` (any call when unset) is held
``EAGLE3_TEST_HOLD_WHEN`` (``before`` it runs or ``after`` it returns): the
calling thread connects to the test's Unix socket ``EAGLE3_TEST_HOLD_SOCKET``
(an abstract name), says which process it is, and waits there until the test
answers or closes the socket (or goes away). The test kills it there: the point
the test means, however fast or slow the machine.

``EAGLE3_TEST_RECORD_AT=module:Qualified.name[,module:Qualified.name...]`` with
``EAGLE3_TEST_RECORD_FILE=path``: every call of each named function is recorded
before it runs, one JSON line (``at``, ``pid``, ``sid``: the session, which tells
the nodes of a local Ray cluster apart) appended to that file, and
nothing else changes. This is how a test counts calls of the product (an engine
built, say) from evidence the product does not write itself
(tests/hold_point.py: :class:`CallRecord`).

``EAGLE3_TEST_DAEMON_TICK_S=2``: Dagster's backfill daemon wakes every that many
seconds instead of 30, a constant with no setting
(``dagster._daemon.controller.DEFAULT_DAEMON_INTERVAL_SECONDS``), set as that
module is first imported. A backfill of ``prompts -> raw_responses ->
validated_traces`` is submitted one asset level per wake-up (their backfill
policies differ): the UI test's three-shard backfill spent about 90 of its 127
seconds waiting on that clock (tests/dagster_dev.py: ``with_daemon_tick``).
"""

import os


def _after_import(names, patch) -> None:
    """``patch(module)`` right after Python first runs each module named in ``names``, wherever it is imported from."""
    import importlib.abc
    import importlib.machinery
    import sys

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in names:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())


if os.environ.get("EAGLE3_TEST_HOLD_AT"):
    import functools
    import json
    import socket
    import threading

    _MODULE, _NAME = os.environ["EAGLE3_TEST_HOLD_AT"].split(":", 1)
    _CALL = int(os.environ.get("EAGLE3_TEST_HOLD_CALL", "1"))
    _MATCH = os.environ.get("EAGLE3_TEST_HOLD_MATCH", "")
    _WHEN = os.environ.get("EAGLE3_TEST_HOLD_WHEN", "after")
    _SOCKET = "\0" + os.environ["EAGLE3_TEST_HOLD_SOCKET"]

    def _mentions(args, kwargs) -> bool:
        if not _MATCH:
            return True
        return any(isinstance(a, (str, os.PathLike)) and _MATCH in os.fspath(a) for a in (*args, *kwargs.values()))

    def _hold(call: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
            held.connect(_SOCKET)
            held.sendall(json.dumps({"pid": os.getpid(), "at": os.environ["EAGLE3_TEST_HOLD_AT"], "call": call, "when": _WHEN}).encode() + b"\n")
            held.recv(1)  # until the test answers, closes the socket or kills this process

    def _wrap(original):
        calls, lock = [0], threading.Lock()

        @functools.wraps(original)
        def held(*args, **kwargs):
            if not _mentions(args, kwargs):
                return original(*args, **kwargs)
            with lock:
                calls[0] += 1
                this = calls[0]
            if this == _CALL and _WHEN == "before":
                _hold(this)
            result = original(*args, **kwargs)
            if this == _CALL and _WHEN == "after":
                _hold(this)
            return result

        return held

    def _patch(module) -> None:
        *owners, attribute = _NAME.split(".")
        owner = module
        for name in owners:
            owner = getattr(owner, name)
        setattr(owner, attribute, _wrap(getattr(owner, attribute)))  # an AttributeError names a hold point that is gone

    _after_import({_MODULE}, _patch)


if os.environ.get("EAGLE3_TEST_RECORD_AT"):
    import functools
    import json

    _RECORD_FILE = os.environ["EAGLE3_TEST_RECORD_FILE"]
    _RECORDED: dict[str, list[str]] = {}  # module -> the qualified names recorded in it
    for _target in os.environ["EAGLE3_TEST_RECORD_AT"].split(","):
        _module, _name = _target.strip().split(":", 1)
        _RECORDED.setdefault(_module, []).append(_name)

    def _recording(original, target: str):
        @functools.wraps(original)
        def recorded(*args, **kwargs):
            line = json.dumps({"at": target, "pid": os.getpid(), "sid": os.getsid(0)}).encode() + b"\n"
            fd = os.open(_RECORD_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write of one short line with O_APPEND: lines of several processes do not mix
            finally:
                os.close(fd)
            return original(*args, **kwargs)

        return recorded

    def _record_calls(module) -> None:
        for name in _RECORDED[module.__name__]:
            *owners, attribute = name.split(".")
            owner = module
            for part in owners:
                owner = getattr(owner, part)
            setattr(owner, attribute, _recording(getattr(owner, attribute), f"{module.__name__}:{name}"))

    _after_import(set(_RECORDED), _record_calls)


if os.environ.get("EAGLE3_TEST_DAEMON_TICK_S"):

    def _set_daemon_tick(module) -> None:
        module.DEFAULT_DAEMON_INTERVAL_SECONDS = float(os.environ["EAGLE3_TEST_DAEMON_TICK_S"])

    _after_import({"dagster._daemon.controller"}, _set_daemon_tick)
