"""The documentation stays true to the code: the generated configuration page is current, links resolve."""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def load_generator():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator():
    return load_generator()


@pytest.fixture(scope="module")
def collected(generator):
    return generator.collect()


def test_configuration_page_is_current(generator, collected):
    page = generator.render(collected)
    current = generator.PAGE.read_text(encoding="utf-8")
    diff = "".join(list(difflib.unified_diff(current.splitlines(True), page.splitlines(True), "docs/configuration.md", "generated"))[:60])
    assert current == page, f"docs/configuration.md is out of date: run `python scripts/config_reference.py`\n{diff}"


def test_every_environment_variable_the_code_reads_is_described(generator, collected):
    assert generator.undescribed_variables(collected) == [], "declare these in eagle3_assets/core/settings/environment.py"


def test_environment_variables_name_fields_that_exist(generator, collected):
    fields = {f"{r['key']}.{f['name']}" for r in collected["resources"] for f in r["fields"]}
    named = {field for variable in collected["environment"] for field in variable["gives"]}
    assert named - fields == set()


def test_the_code_reads_project_variables_only_through_their_declaration():
    """No ``os.environ`` / ``getenv`` read of a project variable outside core/settings/environment.py: one default, one parser."""
    reads = re.compile(r"(environ(?:\.get)?\(|environ\[|getenv\()\s*[\"'](EAGLE3_|VLLM_API_KEY|HF_TOKEN)")
    offenders = []
    for top in ("eagle3_assets", "resources", "sensors"):
        for path in sorted((REPO / top).rglob("*.py")):
            if path.name == "environment.py":
                continue
            offenders += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in reads.finditer(path.read_text(encoding="utf-8"))]
    assert offenders == []


def test_defaults_do_not_depend_on_the_environment(generator, monkeypatch):
    """A project variable set where the page is generated changes nothing on the page (the classes are read in a
    child process that sees none of them), though it does change the defaults the code location gives."""
    from resources.vllm_server import VLLMServerResource

    monkeypatch.setenv("EAGLE3_VLLM_URLS", "http://somewhere-else:9000")
    monkeypatch.setenv("EAGLE3_SHARD_SIZE", "7")
    assert VLLMServerResource.from_env().base_urls == ["http://somewhere-else:9000"], "the variable is read: the page could show it"
    page = generator.render(generator.collect())
    assert "somewhere-else" not in page
    assert page == generator.PAGE.read_text(encoding="utf-8"), "a set variable changed docs/configuration.md"


def test_run_config_classes_are_what_dagster_accepts(generator, collected):
    """The classes found from the compute functions' signatures have the fields of Dagster's own config schema."""
    from dagster import AssetsDefinition

    from eagle3_assets.definitions import defs

    nodes = {a.op.name: a.op for a in defs.assets if isinstance(a, AssetsDefinition) and a.is_executable}
    nodes.update({node.name: node for job in defs.jobs if hasattr(job, "graph") for node in job.graph.node_defs})  # asset jobs: their assets, above
    with_config = {name for name, node in nodes.items() if generator.schema_rows(node)}
    assert {c["op"] for c in collected["configs"]} == with_config
    for config in collected["configs"]:
        assert [f["name"] for f in config["fields"]] == [r["name"] for r in generator.schema_rows(nodes[config["op"]])]


def test_check_reports_a_stale_page(generator, collected, tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(generator.render(collected).replace("| `max_tokens` |", "| `max_tokens_old` |"), encoding="utf-8")
    monkeypatch.setattr(generator, "PAGE", stale)
    monkeypatch.setattr(generator, "REPO", tmp_path)
    monkeypatch.setattr(generator, "collect", lambda: collected)
    assert generator.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert generator.main([]) == 0 and generator.main(["--check"]) == 0


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        base = github_anchor(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(REPO)}")
    assert broken == [], f"{page.relative_to(REPO)}: broken links"
