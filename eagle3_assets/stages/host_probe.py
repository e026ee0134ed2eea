"""``host_probe``: what the GPU host offers, reported from the host itself through Dagster Pipes.

Imports each module named in ``extras["modules"]`` in the host's Python and
records its version, lists every GPU (``nvidia-smi``) and, when torch is among
the modules, what torch sees (CUDA available, device count). Writes
``<data>/host_probe/probe.json`` and reports the same as materialisation
metadata (or as a custom message when run from an op, e.g. the
``gpu_host_ready`` job).

Extras: ``modules`` (list, default ``["torch"]``); ``hold_s`` (keep running
that long, silently: how the lock, the pool and cancellation are exercised
without a real GPU job); ``check_name`` (report an
asset check of that name: passed when every module imports).
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time

STAGE = "host_probe"


def probe(modules: list[str]) -> dict:
    from eagle3_assets.core.gpu_host.preflight import import_module_version, query_gpus
    from eagle3_assets.core.storage.shard_paths import lock_dir

    versions, errors = {}, {}
    for name in modules:
        version, error = import_module_version(name)
        versions[name] = version
        if error:
            errors[name] = error
    gpus, gpu_note = query_gpus()
    report = {
        "hostname": socket.gethostname(),
        "python": sys.executable,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "modules": versions,
        "module_errors": errors,
        "gpus": [{"index": g.index, "used_mib": g.used_mib, "total_mib": g.total_mib} for g in gpus],
        "gpu_note": gpu_note,
        # Set by sshd in the stage's session: shows the stage really ran at the far end of SSH.
        "ssh_connection": os.environ.get("SSH_CONNECTION", ""),
        # Where this host's stages take their shard leases (gpu_host.lock_dir, handed to every stage).
        "lock_dir": str(lock_dir()),
    }
    if "torch" in modules and "torch" not in errors:
        import torch

        report["torch_cuda_available"] = bool(torch.cuda.is_available())
        report["torch_cuda_devices"] = int(torch.cuda.device_count())
    return report


def main() -> None:
    from dagster_pipes import open_dagster_pipes

    from eagle3_assets.core.storage.files import asset_dir, stable_hash, write_json_atomic

    with open_dagster_pipes() as context:
        extras = context.extras or {}
        modules = [str(m) for m in extras.get("modules", ["torch"])]
        hold_s = float(extras.get("hold_s", 0))
        context.log.info(f"{STAGE}: probing {len(modules)} modules on {socket.gethostname()}")
        report = probe(modules)
        if hold_s > 0:
            # Quietly, like a long GPU step between log lines: nothing the stage writes may be
            # what makes it notice that the orchestrator went away.
            context.log.info(f"{STAGE}: holding for {hold_s:.0f}s")
            time.sleep(hold_s)
        path = asset_dir(STAGE) / "probe.json"
        write_json_atomic(path, report)
        context.log.info(f"{STAGE}: wrote {path}")

        metadata = {
            "path": {"raw_value": str(path), "type": "path"},
            "hostname": report["hostname"],
            "python": report["python"],
            "python_version": report["python_version"],
            "modules": {"raw_value": report["modules"], "type": "json"},
            "gpu_count": len(report["gpus"]),
            "gpus": {"raw_value": report["gpus"], "type": "json"},
            "ssh_connection": report["ssh_connection"],
            "lock_dir": report["lock_dir"],
        }
        if context.is_asset_step:
            context.report_asset_materialization(metadata=metadata, data_version=stable_hash(report))
            if extras.get("check_name"):
                context.report_asset_check(
                    check_name=str(extras["check_name"]),
                    passed=not report["module_errors"],
                    severity="ERROR",
                    metadata={"module_errors": {"raw_value": report["module_errors"], "type": "json"}},
                )
        else:
            context.report_custom_message(report)


if __name__ == "__main__":
    main()
