"""Write docs/configuration.md from the code's own field descriptions.

    python scripts/config_reference.py           # (re)write the page
    python scripts/config_reference.py --check   # exit 1 when the page is out of date

What is on the page is found, not listed: every resource of
``eagle3_assets.definitions.defs`` (documented as its class under ``resources/``),
every run-config class an asset or op of ``defs`` takes (read from the compute
function's signature), every sensor, and every environment variable the code
reads (found by name in the source). Only what the code cannot say is written
here: what each environment variable means (:data:`ENVIRONMENT`).

Several resource defaults are read from the environment when the code location
loads. So that the page does not depend on who runs this script, the classes
are inspected in a child process whose environment holds none of the
project's variables, and paths of this checkout or this Python are replaced by
placeholders.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "configuration.md"
SOURCE_DIRS = ("eagle3_assets", "resources", "sensors")
# Variables of the project, and those of its dependencies it reads itself. Stripped from the
# child's environment; the EAGLE3_ ones (and VLLM_API_KEY) found in the source are documented.
PROJECT_ENV = re.compile(r"^(EAGLE3_|VLLM_|DAGSTER_PG_)")
ENV_NAME = re.compile(r"[\"'](EAGLE3_[A-Z0-9_]+|VLLM_API_KEY)[\"']")

# What the code cannot say about each environment variable: (default as documented, meaning,
# the resource fields whose default it gives, as `key.field`).
# A variable read by the code and missing here is listed on the page as undescribed, and
# tests/test_docs.py fails until it has a line.
ENVIRONMENT: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "EAGLE3_DATA_DIR": ("`./data`", "root of every asset's files: `<data>/<asset name>/`", ()),
    "EAGLE3_PROMPTS": ("`demo`", "the prompt dataset", ("prompt_dataset.source",)),
    "EAGLE3_SHARD_SIZE": ("128 (64 for `demo`)", "rows per sample shard", ("prompt_dataset.shard_size",)),
    "EAGLE3_VLLM_URLS": ("`http://127.0.0.1:8000`", "generation servers, comma separated; credentials in a URL stay in the environment", ("vllm_server.base_urls",)),
    "EAGLE3_SERVED_MODEL": ("`tiny-reasoner`", "the served model name (vLLM's `--served-model-name`)", ("vllm_server.served_model_name",)),
    "VLLM_API_KEY": ("unset", "the generation servers' API key, bound as a Dagster `EnvVar` (never shown or logged)", ("vllm_server.api_key",)),
    "EAGLE3_GENERATION_POOL_LIMIT": ("1", "limit given to the `vllm_generation` pool when it has none (`make demo`, `make dev`)", ()),
    "EAGLE3_GPU_CHECK_FAULT": ("unset", "fault injection for the tests: the `eagle3-gpu-check` path of that name fails", ()),
    "EAGLE3_TARGET_MODEL": ("`demo`", "the target's HF model directory", ("target_model.path",)),
    "EAGLE3_TRUST_REMOTE_CODE": ("`0`", "`1` lets the target's own code run", ("target_model.trust_remote_code",)),
    "EAGLE3_AUX_LAYER_IDS": ("`(2, L//2, L-3)`", "three layer ids in vLLM's convention, e.g. `2,30,58`", ("target_model.aux_layer_ids",)),
    "EAGLE3_GPU_HOST": ("`local`", "`local` or `ssh://[user@]host[:port]`", ("gpu_host.mode", "gpu_host.ssh_host", "gpu_host.ssh_port", "gpu_host.ssh_user")),
    "EAGLE3_GPU_HOST_PYTHON": ("this Python (local), `python3` (ssh)", "the host's Python", ("gpu_host.python",)),
    "EAGLE3_GPU_HOST_WORKDIR": ("`.`", "working directory of stage processes", ("gpu_host.working_dir",)),
    "EAGLE3_GPU_HOST_DATA_DIR": ("`$EAGLE3_DATA_DIR` (local only)", "the data directory on the host, required for ssh", ("gpu_host.data_dir",)),
    "EAGLE3_GPU_HOST_ALLOW_CPU": ("`1`", "`0`: only stages that declare `cpu_allowed` run without a GPU", ("gpu_host.allow_cpu",)),
    "EAGLE3_SSH_IDENTITY_FILE": ("ssh's default", "private key on the orchestrator", ("gpu_host.ssh_identity_file",)),
    "EAGLE3_SSH_KNOWN_HOSTS": ("`strict`", "host key policy", ("gpu_host.ssh_known_hosts",)),
    "EAGLE3_SSH_KNOWN_HOSTS_FILE": ("ssh's default", "known_hosts file", ("gpu_host.ssh_known_hosts_file",)),
    "EAGLE3_GPU_POOL": ("`gpu_host`", "the Dagster pool of the GPU stages (one per GPU host)", ()),
    "EAGLE3_GPU_POOL_LIMIT": ("1", "limit given to the GPU pool when it has none", ()),
    "EAGLE3_ALLOW_CPU": ("`1`", "set by the GPU host for each stage process from `allow_cpu`; not set by hand", ()),
    "EAGLE3_ALERT_WEBHOOK_URL": ("unset", "Slack-compatible incoming webhook for alerts (a secret, `EnvVar`)", ("alert_channel.webhook_url",)),
    "EAGLE3_SLACK_BOT_TOKEN": ("unset", "Slack bot token, alerts through `dagster-slack` (a secret, `EnvVar`)", ("alert_channel.slack_token",)),
    "EAGLE3_SLACK_CHANNEL": ("`#eagle3-alerts`", "the channel used with the Slack token", ("alert_channel.slack_channel",)),
    "EAGLE3_UI_BASE_URL": ("`http://127.0.0.1:3000`", "base of the run links in alerts (the proxy's address in production)", ("alert_channel.ui_base_url",)),
    "EAGLE3_PRODUCTION_URLS": ("unset", "production servers the `deployed_draft_watch` sensor reads, comma separated", ("production_servers.base_urls",)),
    "EAGLE3_PRODUCTION_API_KEY": ("unset", "their API key (`EnvVar`)", ("production_servers.api_key",)),
    "EAGLE3_PRODUCTION_SCRAPE_S": ("300", "seconds between two scrapes of the production servers", ()),
    "EAGLE3_AUTO_GENERATE": ("unset", "`1`: `new_prompt_shards` also requests a `prompts` + `raw_responses` run per new shard", ()),
    "EAGLE3_LEASE_STALE_AFTER_S": ("900", "a shard lease held from another host is taken over after this many seconds without heartbeat", ()),
    "EAGLE3_LEASE_TAKEOVER": ("unset", "hosts (comma separated, or `*`) whose leases may be taken over at once", ()),
    "EAGLE3_DAGSTER_URL": ("`http://127.0.0.1:3000`", "the webserver `python -m eagle3_assets.backfill` talks to", ()),
    "EAGLE3_DEMO_TARGET": ("`tiny`", "the built-in target `make demo` uses (`make demo DEMO_TARGET=kimi`)", ()),
    "EAGLE3_TINY_TARGET_DIR": ("`<data>/demo/tiny_target`", "where the built-in tiny target is cached (the tests use `.cache/`)", ()),
    "EAGLE3_ACCEPT_TARGET_FINGERPRINT": ("`0`", "`1`: use a built-in target whose greedy outputs differ from the recorded ones (`eagle3_assets/demo/target_fingerprints.json`)", ()),
    "EAGLE3_KIMI_TARGET_DIR": ("`<data>/demo/kimi_target`", "where the built-in Kimi-family target is cached", ()),
    "EAGLE3_QWEN3_TARGET_DIR": ("`<data>/demo/qwen3_target`", "where the built-in Qwen3 target is cached", ()),
}

INTRO = """\
# Configuration reference

<!-- Generated by scripts/config_reference.py from the code's field descriptions: do not edit by hand.
     Regenerate with `python scripts/config_reference.py`; tests/test_docs.py fails when this page is stale. -->

Every knob is one of three things:

- an **environment variable**, read when the code location loads (restart `make dev` or reload
  the location after changing one). The environment gives the resources' defaults for this
  deployment; secrets are bound as Dagster `EnvVar`s and never shown in the launchpad or logs;
- a **resource field**, set per run under `resources: <key>: config:` in the launchpad. Run
  config for a resource *replaces* the values the code location gave it as a whole: fields it
  does not name take their class defaults. Where the class default is itself read from the
  environment (`vllm_server`'s servers and model, `target_model`, `production_servers`' URLs;
  `VLLM_API_KEY` is read again at run time), an override keeps the environment's value; values
  the code location passes in (the GPU host's, the alert channel's, the prompt dataset's, the
  demo's sampling) it does not, so an override names every field it needs;
- an asset's **run config**, set per run under `ops: <asset>: config:`.

```yaml
resources:
  vllm_server:
    config: {max_tokens: 256, temperature: 0.7, concurrency: 64}
ops:
  validated_traces:
    config: {min_reasoning_share: 0.98}
```

Defaults are shown as the code has them with none of the project's environment variables set.
"""


# -- collection, in a child process with a clean environment


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not PROJECT_ENV.match(k)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def collect() -> dict:
    """What the page is made of, gathered by a child process that imports ``defs`` in a clean environment."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--collect"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"collecting the configuration failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def type_name(annotation) -> str:
    """``list[int] | None``-style text for an annotation (``Optional[X]`` written as ``X | None``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(names + (["None"] if type(None) in args else []))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if args else getattr(origin, "__name__", str(origin))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def placeholders() -> list[tuple[str, str]]:
    """Machine-specific text and what the page says instead (longest first)."""
    pairs = [(sys.executable, "<this Python>"), (str(REPO), "<repo>"), (str(Path.home()), "~")]
    return sorted(((a, b) for a, b in pairs if a), key=lambda p: -len(p[0]))


def show(value) -> str:
    text = repr(value)
    for actual, placeholder in placeholders():
        text = text.replace(actual, placeholder)
    return text


def field_rows(model) -> list[dict]:
    from pydantic_core import PydanticUndefined

    rows = []
    for name, info in model.model_fields.items():
        if info.default_factory is not None:
            default = show(info.default_factory())
        elif info.default is PydanticUndefined:
            default = "required"
        else:
            default = show(info.default)
        rows.append({"name": name, "type": type_name(info.annotation), "default": default, "description": info.description or ""})
    return rows


def documented_class(resource) -> type:
    """The resource's class under ``resources/``: a deployment's subclass documents as its platform class."""
    for cls in type(resource).__mro__:
        if cls.__module__.split(".")[0] == "resources":
            return cls
    return type(resource)


def config_class(node_def):
    """The run-config class a compute function takes (Dagster names that parameter ``config``), or None."""
    from dagster import Config, ConfigurableResource

    fn = getattr(node_def.compute_fn, "decorated_fn", node_def.compute_fn)
    try:
        annotation = typing.get_type_hints(fn).get("config")
    except Exception:  # an annotation that does not resolve: read the signature as written
        parameter = inspect.signature(fn).parameters.get("config")
        annotation = parameter.annotation if parameter is not None else None
    if inspect.isclass(annotation) and issubclass(annotation, Config) and not issubclass(annotation, ConfigurableResource):
        return annotation
    return None


def schema_type(config_type) -> str:
    kind = config_type.kind.name
    if kind == "NONEABLE":
        return f"{schema_type(config_type.inner_type)} | None"
    if kind == "ARRAY":
        return f"list[{schema_type(config_type.inner_type)}]"
    if kind == "SCALAR_UNION":  # a scalar that may also be given as a selector: show the scalar
        return schema_type(config_type.scalar_type)
    return config_type.given_name or kind.lower()


def schema_rows(node_def) -> list[dict]:
    """The op's config fields as Dagster's schema has them: for config given without a ``Config`` class."""
    config_type = node_def.config_schema.config_type
    rows = []
    for name, field in (getattr(config_type, "fields", None) or {}).items():
        rows.append({
            "name": name,
            "type": schema_type(field.config_type),
            "default": show(field.default_value) if field.default_provided else ("required" if field.is_required else "None"),
            "description": field.description or "",
        })  # fmt: skip
    return rows


def own_doc(cls) -> str:
    """The first paragraph of the class's own docstring (not one inherited from Dagster's base classes)."""
    doc = cls.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split()) if doc else ""


def env_reads() -> dict[str, list[str]]:
    """Every project environment variable named in the source, with the files that name it."""
    found: dict[str, set[str]] = {}
    for top in SOURCE_DIRS:
        for path in sorted((REPO / top).rglob("*.py")):
            for name in ENV_NAME.findall(path.read_text(encoding="utf-8")):
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return {name: sorted(files) for name, files in sorted(found.items())}


def collect_here() -> dict:
    from dagster import AssetsDefinition

    from eagle3_assets.definitions import defs

    resources = []
    for key in sorted(defs.resources):
        instance = defs.resources[key]
        cls = documented_class(instance)
        if not hasattr(cls, "model_fields"):
            continue
        rows = field_rows(cls)
        # What defs gives the resource beyond its class defaults (the deployment's values, here the demo's).
        configured = {}
        for row in rows:
            value = getattr(instance, row["name"], None)
            if show(value) != row["default"] and row["default"] != "required":
                configured[row["name"]] = show(value)
        resources.append({
            "key": key, "class": f"{cls.__module__}.{cls.__qualname__}", "doc": own_doc(cls),
            "fields": rows, "configured": configured,
        })  # fmt: skip

    configs, seen = [], set()
    nodes = [(a.op.name, a.op) for a in defs.assets if isinstance(a, AssetsDefinition) and a.is_executable]
    nodes += [(f"{job.name}: {node.name}", node) for job in defs.jobs for node in job.graph.node_defs]
    for where, node_def in nodes:
        if where in seen:
            continue
        seen.add(where)
        cls = config_class(node_def)
        if cls is not None:
            configs.append({
                "where": where, "op": node_def.name, "class": f"{cls.__module__}.{cls.__qualname__}",
                "doc": own_doc(cls), "fields": field_rows(cls),
            })  # fmt: skip
        elif schema_rows(node_def):  # config without a Config class: still on the page, from Dagster's schema
            configs.append({"where": where, "op": node_def.name, "class": "Dagster config schema", "doc": "", "fields": schema_rows(node_def)})

    sensors = [
        {
            "name": s.name,
            "status": "running" if s.default_status.value == "RUNNING" else "stopped",
            "interval": s.minimum_interval_seconds,
            "description": s.description or "",
        }
        for s in sorted(defs.sensors, key=lambda s: s.name)
    ]
    return {"resources": resources, "configs": configs, "sensors": sensors, "environment": env_reads()}


# -- rendering


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    return f"`{text}`" if text else ""


def env_for_fields() -> dict[str, list[str]]:
    """``key.field`` -> the variables that give its default."""
    out: dict[str, list[str]] = {}
    for name, (_, _, fields) in ENVIRONMENT.items():
        for field in fields:
            out.setdefault(field, []).append(name)
    return out


def field_table(rows: list[dict], env: dict[str, list[str]] | None, prefix: str) -> list[str]:
    with_env = env is not None
    head = "| field | type | default |" + (" environment |" if with_env else "") + " description |"
    lines = [head, "| --- | --- | --- |" + (" --- |" if with_env else "") + " --- |"]
    for row in rows:
        line = f"| `{row['name']}` | {code(cell(row['type']))} | {code(cell(row['default']))} |"
        if with_env:
            line += " " + ", ".join(f"`{v}`" for v in env.get(f"{prefix}.{row['name']}", [])) + " |"
        lines.append(line + f" {cell(row['description'])} |")
    return lines


def render(data: dict | None = None) -> str:
    data = data if data is not None else collect()
    env_fields = env_for_fields()
    out = [INTRO]

    out += ["## Contents", ""]
    out += ["- [Resources](#resources)"] + [f"  - [`{r['key']}`](#{r['key']})" for r in data["resources"]]
    out += ["- [Run config of assets and jobs](#run-config-of-assets-and-jobs)"]
    out += [f"  - [`{c['op']}`](#{c['op']})" for c in data["configs"]]
    out += ["- [Sensors](#sensors)", "- [Environment variables](#environment-variables)", ""]

    out += ["## Resources", ""]
    for r in data["resources"]:
        out += [f"### {r['key']}", "", f"`{r['class']}`: {r['doc']}" if r["doc"] else f"`{r['class']}`", ""]
        out += [f"Launchpad: `resources: {{{r['key']}: {{config: {{...}}}}}}`.", ""]
        out += field_table(r["fields"], env_fields, r["key"]) + [""]
        if r["configured"]:
            values = ", ".join(f"`{k}` = `{cell(v)}`" for k, v in r["configured"].items())
            out += [f"With no environment set, the code location gives it: {values}.", ""]

    out += ["## Run config of assets and jobs", ""]
    for c in data["configs"]:
        out += [f"### {c['op']}", ""]
        where = f"job `{c['where'].split(':')[0]}`, op `{c['op']}`" if ":" in c["where"] else f"asset `{c['where']}`"
        out += [f"`{c['class']}`, the run config of {where}" + (f": {c['doc']}" if c["doc"] else "."), ""]
        out += [f"Launchpad: `ops: {{{c['op']}: {{config: {{...}}}}}}`.", ""]
        out += field_table(c["fields"], None, c["op"]) + [""]

    out += ["## Sensors", "", "Turned on or off in the UI (Automation) or with `dagster sensor start|stop NAME -w workspace.yaml`.", ""]
    out += ["| sensor | default | every (s) | what it does |", "| --- | --- | --- | --- |"]
    out += [f"| `{s['name']}` | {s['status']} | {s['interval']} | {cell(s['description'])} |" for s in data["sensors"]]
    out += [""]

    out += ["## Environment variables", ""]
    out += ["Every variable of the project that the code reads (found in `eagle3_assets/`, `resources/`, `sensors/`).", ""]
    out += ["| variable | default | meaning | read in |", "| --- | --- | --- | --- |"]
    undescribed = []
    for name, files in data["environment"].items():
        default, meaning, fields = ENVIRONMENT.get(name, ("", "", ()))
        if fields:
            meaning += "; the default of " + ", ".join(f"`{f}`" for f in fields)
        if not meaning:
            undescribed.append(name)
            meaning = "**not yet described** (add it to `ENVIRONMENT` in scripts/config_reference.py)"
        out.append(f"| `{name}` | {default} | {meaning} | {', '.join(f'`{f}`' for f in files)} |")
    out += [""]
    return "\n".join(out)


def undescribed_variables(data: dict) -> list[str]:
    return [name for name in data["environment"] if name not in ENVIRONMENT]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is not what the code gives")
    parser.add_argument("--collect", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.collect:
        sys.path.insert(0, str(REPO))
        print(json.dumps(collect_here()))
        return 0
    page = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.is_file() else ""
        if current != page:
            print(
                f"{PAGE.relative_to(REPO)} is out of date with the code's field descriptions: "
                "run `python scripts/config_reference.py` and commit the result",
                file=sys.stderr,
            )
            return 1
        print(f"{PAGE.relative_to(REPO)} is up to date")
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
