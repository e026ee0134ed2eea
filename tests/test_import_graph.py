"""No import cycle among the modules of ``eagle3_assets``, ``core``'s folders stacked in layers (none imports
its own layer or one above), no asset module imports another, and the code location loads without torch.

Every import statement counts, those inside functions too: a function-level
import that closes a cycle still ties the two modules together (one cannot be
read, moved or tested without the other), it only hides the cycle from the
interpreter until the function runs. Imports under ``if TYPE_CHECKING:`` are
left out: they never run.

An asset module (one that defines an ``@asset`` or ``@multi_asset``) is a
thin wrapper over ``core/``: what two assets share (a config class, a table of
gates, a helper) lives below both, so that reading, testing or changing one
asset never drags in another, and the graph stays low.

``core``'s folders are layered (:data:`CORE_LAYERS`): a folder imports only the
folders of the layers below its own, and nothing of ``eagle3_assets`` outside
``core``. The layers say where a thing goes: a stage's job is its domain's
(``core/extraction/job.py`` ...), not the transport's (``core/gpu_host``), which
carries a job it never reads.

``python tests/test_import_graph.py`` prints the measures: modules, imports,
the longest chain of module imports, the layers and the imports that run back
up them.

The graph is read from the source (``ast``), not by importing, so the test
needs no GPU, no vLLM and no Dagster instance, and names the cycle it finds;
only the code location's load is tried for real, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes that sit under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skipped.update(id(n) for n in ast.walk(child))
    return skipped


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (``from pkg import module`` resolves to the module)."""
    files = sorted((root / package.replace(".", "/")).rglob("*.py"))
    modules = {_module_name(root, f): f for f in files}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_only(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                edges.update(filter(None, (known(alias.name) for alias in node.names)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    found = f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else known(target)
                    if found:
                        edges.add(found)
        edges.discard(module)
        graph[module] = edges
    return graph


ASSET_DECORATORS = {"asset", "multi_asset"}


def _called_name(node: ast.expr) -> str | None:
    target = node.func if isinstance(node, ast.Call) else node
    return target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None


def asset_modules(root: Path, package: str) -> set[str]:
    """The modules of ``package`` that define an asset: a function decorated ``@asset``/``@multi_asset`` (called or
    not, ``dg.`` or not), or an ``AssetSpec`` of its own at module level (an asset observed, not materialised)."""
    found = set()
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        decorated = any(
            _called_name(decorator) in ASSET_DECORATORS
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for decorator in node.decorator_list
        )
        spec = any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _called_name(node.value) == "AssetSpec" for node in tree.body)
        if decorated or spec:
            found.add(_module_name(root, path))
    return found


def asset_imports(graph: dict[str, set[str]], assets: set[str]) -> list[str]:
    """Each import of an asset module by another, as ``importer -> imported``."""
    return [f"{module} -> {target}" for module in sorted(assets) for target in sorted(graph.get(module, set()) & assets)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# core's folders from the bottom layer up. A folder imports only the folders of the layers below its own: a change
# to a lower folder is read without the higher ones, and a new folder finds its place by what it needs.
CORE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("settings", "reporting"),  # declared settings and environment; check outcomes and their Markdown
    ("storage",),  # atomic files, hashes, shard paths
    ("prompts", "generation"),  # the prompt set; the OpenAI-API client and its responses
    ("validation", "orchestration"),  # the traces' rules; the backfill client
    ("target",),  # the target model: description, identity, tokenizer, head
    ("serving", "cluster"),  # vLLM: its profile, launcher, metrics, deployment; a stage's placement on a Ray cluster
    # The transport of a stage's job, beside extraction so that neither imports the other: gpu_host carries a job it
    # never reads (each stage's job is its domain's job.py); the draft; the states.
    ("gpu_host", "draft", "extraction"),
    ("evaluation", "training"),  # the draft trained on the states; measured through vLLM
    # Capacity and the stages' rates, over extraction and training; on-policy refinement, over the draft served
    # (evaluation's per-step counts) and its states (extraction).
    ("planning", "refinement"),
)


def core_folder(module: str, package: str = "eagle3_assets") -> str | None:
    """The folder of ``package.core`` a module lives in (``None`` outside ``core``'s folders)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == [package, "core"] and len(parts) > 3 else None


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...], package: str = "eagle3_assets") -> list[str]:
    """Each import from a module of ``core`` that runs sideways or up the layers, or out of ``core``, or from a folder
    the layers do not place, as ``importer -> imported (why)``."""
    level = {folder: i for i, layer in enumerate(layers) for folder in layer}
    found = []
    for module in sorted(graph):
        if not module.startswith(f"{package}.core."):
            continue
        source = core_folder(module, package)
        for target in sorted(graph[module]):
            folder = core_folder(target, package)
            if not target.startswith(f"{package}.core"):
                found.append(f"{module} -> {target} (core imports nothing above core)")
            elif source is None or folder is None or source == folder:
                continue
            elif source not in level or folder not in level:
                found.append(f"{module} -> {target} (folder {source if source not in level else folder!r} has no layer)")
            elif level[folder] >= level[source]:
                found.append(f"{module} -> {target} ({folder} is not below {source})")
    return found


def chain_height(graph: dict[str, set[str]]) -> int:
    """Modules in the longest chain of imports (the graph has no cycle: the test above holds it)."""
    memo: dict[str, int] = {}

    def height(module: str) -> int:
        if module not in memo:
            memo[module] = 0  # a cycle, if one slipped in, counts once rather than recursing forever
            memo[module] = 1 + max((height(t) for t in graph.get(module, ())), default=0)
        return memo[module]

    return max(map(height, graph), default=0)


@functools.cache
def platform_graph() -> dict[str, set[str]]:
    """This checkout's graph, read once for the tests that read it (each read parses every module)."""
    return import_graph(REPO, "eagle3_assets")


@functools.cache
def platform_assets() -> frozenset[str]:
    return frozenset(asset_modules(REPO, "eagle3_assets"))


def test_cores_folders_import_only_the_layers_below_them():
    """Before issue 40, ``core/gpu_host/stage_jobs.py`` held every stage's job: extraction, training and evaluation
    imported it and it imported them (folders in one cycle, 12 imports inside it). Mutation: add
    ``from eagle3_assets.core.extraction.job import ExtractionJob`` to ``core/gpu_host/remote.py``; this test fails
    naming ``core.gpu_host.remote -> core.extraction.job (extraction is not below gpu_host)``; or the other way, add
    ``from eagle3_assets.core.gpu_host import stage_requirements`` to ``core/extraction/shard_record.py``: it names
    ``(gpu_host is not below extraction)``."""
    graph = platform_graph()
    folders = {core_folder(m) for m in graph} - {None}
    placed = {f for layer in CORE_LAYERS for f in layer}
    assert folders == placed, f"core's folders and CORE_LAYERS differ: unplaced {sorted(folders - placed)}, gone {sorted(placed - folders)}"
    found = upward_imports(graph, CORE_LAYERS)
    assert found == [], "imports that run back up core's layers (move the thing imported down, or the importer up):\n" + "\n".join(found)


def test_the_layer_rule_names_sideways_upward_and_outward_imports(tmp_path):
    core = tmp_path / "pkg" / "core"
    for folder in ("low", "high", "peer", "loose"):
        (core / folder).mkdir(parents=True)
        (core / folder / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (tmp_path / "pkg" / "asset.py").write_text("from pkg.core.high import h\n")  # above core: free to import it
    (core / "high" / "h.py").write_text("from pkg.core.low import l\nfrom pkg.core.high import h2\n")  # down, and within
    (core / "high" / "h2.py").write_text("")
    (core / "low" / "l.py").write_text("def later():\n    from pkg.core.high import h2\n")  # up, inside a function
    (core / "peer" / "p.py").write_text("from pkg.core.high import h2\nimport pkg.asset\n")  # sideways; out of core
    (core / "loose" / "x.py").write_text("from pkg.core.low import l\n")  # a folder with no layer
    graph = import_graph(tmp_path, "pkg")
    assert upward_imports(graph, (("low",), ("high", "peer")), "pkg") == [
        "pkg.core.loose.x -> pkg.core.low.l (folder 'loose' has no layer)",
        "pkg.core.low.l -> pkg.core.high.h2 (high is not below low)",
        "pkg.core.peer.p -> pkg.asset (core imports nothing above core)",
        "pkg.core.peer.p -> pkg.core.high.h2 (high is not below peer)",
    ]
    assert chain_height(graph) == 5  # p -> asset -> h -> l -> h2


def test_no_import_cycle_among_the_platforms_modules():
    graph = platform_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the graph was not read (wrong root?)"
    found = cycles(graph)
    assert found == [], "import cycles (each line: modules that import one another, directly or not):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_asset_module_imports_another():
    graph = platform_graph()
    assets = set(platform_assets())
    assert {"eagle3_assets.defs.prompts", "eagle3_assets.defs.hidden_states", "eagle3_assets.defs.deployed_draft"} <= assets, assets
    found = asset_imports(graph, assets)
    assert found == [], (
        "asset modules import other asset modules (move what they share below both: core/, stage_configs.py):\n" + "\n".join(found)
    )


def test_the_asset_modules_are_defs_and_the_glue_sits_below_them():
    """Issue 40: the top level says what is an asset. Every asset module lives in ``defs/`` (beside the jobs, which
    define ops and no asset), every other module of ``defs/`` is a part of one asset (imported by that asset's
    module and no other), and ``glue/`` (what the assets share) imports nothing of ``defs/``. Mutation: move ``defs/deployed_draft.py`` back to the top level, or
    import ``eagle3_assets.defs.prompts`` from ``glue/partitions.py``; this test fails naming it."""
    graph = platform_graph()
    outside = sorted(m for m in platform_assets() if not m.startswith("eagle3_assets.defs."))
    assert outside == [], f"asset modules outside eagle3_assets/defs/: {outside}"
    defs = {m for m in graph if m.startswith("eagle3_assets.defs.")}
    jobs = {m for m in defs if "@job" in (REPO / (m.replace(".", "/") + ".py")).read_text(encoding="utf-8")}
    importers = {m: sorted(i for i in graph if m in graph[i]) for m in defs - set(platform_assets()) - jobs}
    shared = sorted(f"{m} (imported by {by})" for m, by in importers.items() if len(by) != 1 or by[0] not in platform_assets())
    assert shared == [], "modules in defs/ that are no asset, no job and no part of one asset (glue/ or core/ is their place):\n" + "\n".join(shared)
    upward = sorted(f"{m} -> {t}" for m in graph if m.startswith("eagle3_assets.glue.") for t in graph[m] if t.startswith("eagle3_assets.defs"))
    assert upward == [], "glue imports an asset module (move what it needs into glue/ or core/):\n" + "\n".join(upward)


def test_the_asset_rule_names_an_asset_module_importing_another(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "shared.py").write_text("LIMIT = 1\n")
    (package / "upstream.py").write_text("import dagster as dg\n\n@dg.asset\ndef upstream(): ...\n")
    (package / "downstream.py").write_text(
        "from dagster import multi_asset\nfrom pkg.upstream import upstream\nfrom pkg import shared\n\n@multi_asset(specs=[])\ndef downstream(): ...\n"
    )
    (package / "observed.py").write_text("from dagster import AssetSpec\nfrom pkg.upstream import upstream\nobserved = AssetSpec('observed')\n")
    (package / "graph.py").write_text("from pkg import downstream, observed, upstream\n")  # the definitions gather every asset: allowed
    graph = import_graph(tmp_path, "pkg")
    assets = asset_modules(tmp_path, "pkg")
    assert assets == {"pkg.upstream", "pkg.downstream", "pkg.observed"}
    assert asset_imports(graph, assets) == ["pkg.downstream -> pkg.upstream", "pkg.observed -> pkg.upstream"]


def test_the_checker_finds_a_cycle_closed_inside_a_function_and_ignores_type_checking_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def later():\n    from ..c import thing\n")
    (package / "c.py").write_text("from . import a\nthing = 1\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n")
    (package / "e.py").write_text("import pkg.d\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


# What declares a gate or builds a check by hand: in core (a gate's declaration) and check_results.py (the adapter) only.
GATE_BUILDERS = {"Gate", "GateTable", "AssetCheckSpec", "AssetCheckResult", "AssetCheckSeverity"}
# host_probe reports a check of whatever name its caller sends (a probe of the host, used by tests): no gate of the product.
NOT_GATES = {"eagle3_assets.stages.host_probe"}


def hand_made_checks(root: Path, package: str, modules: set[str]) -> list[str]:
    """Each place in ``modules`` (and the stages) that declares a gate, builds a check spec or result, or names a
    severity itself, instead of adapting a table declared in core: ``module:line what``."""
    found = []
    files = {_module_name(root, p): p for p in (root / package.replace(".", "/")).rglob("*.py")}
    stages = {m for m in files if m.startswith(f"{package}.stages.")} - NOT_GATES
    for module in sorted(modules | stages):
        path = files[module]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Name, ast.Attribute)) and _called_name(node) in GATE_BUILDERS:
                found.append(f"{module}:{node.lineno} {_called_name(node)}")
            elif isinstance(node, ast.keyword) and node.arg == "severity" and isinstance(node.value, ast.Constant):
                found.append(f"{module}:{node.value.lineno} severity={node.value.value!r}")
    return found


def test_asset_modules_and_stages_only_adapt_the_gates_core_declares():
    """Each gate is declared once, in ``core/<domain>/gates.py`` beside its check, with its severity; an asset module
    adapts the table (``CHECKS = AssetChecks(...)``) and a stage reports the declared severity. Mutations: give
    ``capacity_plan`` an ``AssetCheckSpec`` of its own, or report ``severity="WARN"`` from ``stages/evaluate_draft.py``:
    this test names the line."""
    found = hand_made_checks(REPO, "eagle3_assets", set(platform_assets()))
    assert found == [], "gates declared or checks built outside core's gates.py and check_results.py:\n" + "\n".join(found)


# Imported in the Dagster processes only by the stages that need them (on the GPU host, or in a worker's function).
HEAVY_PACKAGES = ("torch", "transformers", "vllm", "safetensors")


def test_the_code_location_loads_without_the_ml_packages():
    """The code server, the daemon and every run's worker load ``eagle3_assets.definitions``; torch alone adds
    seconds and about 190 MB to each, and none of them computes with it (the stages do, in their own processes)."""
    probe = "import sys, eagle3_assets.definitions; print(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:])))"
    out = subprocess.run([sys.executable, "-c", probe, *HEAVY_PACKAGES], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]", f"loading the code location imported {out.stdout.strip()}"


if __name__ == "__main__":
    graph = platform_graph()
    print(f"modules {len(graph)}, imports {sum(map(len, graph.values()))}, longest import chain {chain_height(graph)} modules")
    print(f"core: {len(CORE_LAYERS)} layers of {sum(map(len, CORE_LAYERS))} folders")
    up = upward_imports(graph, CORE_LAYERS)
    print(f"imports back up core's layers: {len(up)}", *up, sep="\n  ")
