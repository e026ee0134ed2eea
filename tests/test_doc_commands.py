"""Every command the docs tell a user to type exists and takes the options the docs give it.

The commands are read from the shell blocks of README.md and docs/*.md. The
project's own entry points are run, with ``--help``: a module without a
``__main__``, a script that is gone or a flag it no longer takes fails here
(the docs once ran ``-m eagle3_assets.core.training``, which has no entry
point). ``make`` targets must have a rule, and so must every ``.PHONY`` one.
What the commands do when run for real is the subject of the other tests
(``make demo``: test_end_to_end; the training worker: test_distributed_training).
Other programs' commands (git, sudo, pip, vLLM's server) are checked to be
installed where they are Python modules, and otherwise left alone.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)
PROJECT_PACKAGES = ("eagle3_assets", "resources", "sensors")
PYTHON = re.compile(r"^(\S*/)?python3?$")


def doc_commands() -> list[tuple[str, str]]:
    """(page, command) for every command line of every shell block (continuations joined, comments and env prefixes dropped)."""
    found = []
    for page in PAGES:
        for language, body in FENCE.findall(page.read_text(encoding="utf-8")):
            if language not in ("", "bash", "sh", "shell", "console"):
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                for part in re.split(r"\s*&&\s*", line):
                    words = _words(part)
                    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
                        words = words[1:]
                    if words and _is_command(words):
                        found.append((str(page.relative_to(REPO)), shlex.join(words)))
    return found


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return []


def _is_command(words: list[str]) -> bool:
    return bool(PYTHON.match(words[0])) or words[0] in ("make", "torchrun", "eagle3-vllm-serve", "dagster")


def make_rules() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", (REPO / "Makefile").read_text(), re.M))


def entry_module(words: list[str]) -> tuple[str | None, list[str]]:
    """The module a ``python -m`` line runs (for a torchrun launcher: the module it starts), and its arguments."""
    if words[0] == "torchrun":
        words = ["python", "-m", "torch.distributed.run", *words[1:]]
    if len(words) < 3 or words[1] != "-m":
        return None, []
    module, args = words[2], words[3:]
    if module == "torch.distributed.run" and "-m" in args:  # the launcher's own options come before the worker's -m
        i = args.index("-m")
        return args[i + 1], args[i + 2 :]
    return module, args


def flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def run_help(command: list[str]) -> str:
    done = subprocess.run(
        [*command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )  # fmt: skip
    assert done.returncode == 0, f"{' '.join(command)} --help failed:\n{done.stderr[-2000:]}"
    return done.stdout


def check_flags(where: str, help_text: str, args: list[str]) -> None:
    unknown = [f for f in flags(args) if f != "--help" and f not in help_text]
    assert not unknown, f"{where}: the docs pass {unknown}, which its --help does not list"


COMMANDS = doc_commands()


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) > 20 and any("-m eagle3_assets" in c for _, c in COMMANDS)


def test_every_phony_make_target_has_a_rule():
    phony = set(re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M).group(1).split())
    assert phony - make_rules() == set()


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_a_documented_command_exists_and_takes_its_options(page, command):
    words = shlex.split(command)
    where = f"{page}: `{command}`"
    if words[0] == "make":
        targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
        assert set(targets) <= make_rules(), f"{where}: no Makefile rule for {set(targets) - make_rules()}"
        return
    if words[0] == "eagle3-vllm-serve":
        scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
        module, _, function = scripts["eagle3-vllm-serve"].partition(":")
        check_flags(where, run_help([sys.executable, "-c", f"import sys; from {module} import {function} as m; m(sys.argv[1:])"]), words[1:])
        return
    if words[0] == "dagster":
        assert (Path(sys.executable).parent / "dagster").exists(), f"{where}: dagster's CLI is not installed"
        return
    module, args = entry_module(words)
    if module is not None:
        assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        if module.split(".")[0] in PROJECT_PACKAGES:
            check_flags(where, run_help([sys.executable, "-m", module]), args)
        elif module == "pytest":
            paths = [a for a in args if a.startswith("tests/")]
            assert all((REPO / p).exists() for p in paths), f"{where}: no such test file"
        return
    if len(words) > 2 and words[1] == "-c":
        compile(words[2], where, "exec")  # the one-liner is Python (running it needs the data it reads)
        return
    script = REPO / words[1]
    assert script.is_file(), f"{where}: no script {words[1]}"
    check_flags(where, run_help([sys.executable, str(script)]), [a.strip("[]") for a in words[2:]])
