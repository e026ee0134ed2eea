"""The embedded target: reproducible from its seed, reasoning-shaped, and served by real vLLM."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import urllib.request

import pytest

from eagle3_assets.core.storage import file_hash
from eagle3_assets.demo.prompt_set import demo_prompts, eval_prompts
from eagle3_assets.demo.tiny_target import THINK_CLOSE, THINK_OPEN, TinyTargetSpec, build_tiny_target


def test_same_seed_builds_the_same_target(tmp_path):
    spec = dataclasses.replace(TinyTargetSpec(), train_steps=8)
    first = build_tiny_target(tmp_path / "a", spec, log=lambda _: None)
    second = build_tiny_target(tmp_path / "b", spec, log=lambda _: None)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert file_hash(first / name) == file_hash(second / name), name
    other = build_tiny_target(tmp_path / "c", dataclasses.replace(spec, seed=1), log=lambda _: None)
    assert file_hash(other / "model.safetensors") != file_hash(first / "model.safetensors")


def test_think_markers_are_single_non_special_tokens(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    for marker in (THINK_OPEN, THINK_CLOSE):
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, marker
        assert marker not in tok.all_special_tokens
        assert tok.decode(ids, skip_special_tokens=True) == marker  # survives detokenisation
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi?"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(f"<|im_start|>assistant\n{THINK_OPEN}\n")


def test_held_out_prompts_never_appear_in_the_demo_set():
    demo = {p["conversations"][0]["value"] for p in demo_prompts()}
    held_out = {p["question"] for p in eval_prompts()}
    assert len(demo) > 200 and len(held_out) >= 30
    assert not demo & held_out


def chat(server, content, timeout_s: float = 120, **sampling):
    body = {"model": server.served_model_name, "messages": [{"role": "user", "content": content}], **sampling}
    request = urllib.request.Request(
        f"{server.base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)["choices"][0]


@pytest.mark.vllm
def test_launcher_serves_reasoning_through_real_vllm(vllm_server):
    choice = chat(vllm_server, "What is 3 plus 4?", max_tokens=128, temperature=0)
    assert choice["message"]["reasoning"].strip(), choice
    with urllib.request.urlopen(f"{vllm_server.base_url}/v1/models", timeout=10) as response:
        (model,) = json.load(response)["data"]
    assert model["id"] == vllm_server.served_model_name


def complete_reasoning_answers(server, label: str, timeout_s: float = 120, count: int = 96) -> list[tuple[str, dict]]:
    """Ask ``count`` demo questions with the demo's sampling; assert >= 90 % come back as reasoning + answer, return those.

    A complete answer stopped by itself and carries both non-empty reasoning and
    non-empty content: what a target trained to reason answers, as its server parses it.
    """
    from concurrent.futures import ThreadPoolExecutor

    from eagle3_assets.demo.plugin import MAX_TOKENS, TEMPERATURE

    questions = [p["conversations"][0]["value"] for p in demo_prompts()[:count]]
    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(lambda q: chat(server, q, timeout_s=timeout_s, max_tokens=MAX_TOKENS, temperature=TEMPERATURE), questions))
    complete = [
        (q, c) for q, c in zip(questions, choices)
        if c["finish_reason"] == "stop" and (c["message"]["reasoning"] or "").strip() and (c["message"]["content"] or "").strip()
    ]  # fmt: skip
    print(f"{label} under vLLM: {len(complete)}/{len(choices)} responses complete reasoning + answer")
    assert len(complete) / len(choices) >= 0.9, f"{len(complete)}/{len(choices)} complete"
    return complete


@pytest.mark.vllm
def test_ninety_percent_of_demo_responses_are_complete_reasoning(vllm_server):
    complete_reasoning_answers(vllm_server, "tiny target")


def test_launcher_stops_the_whole_process_group_when_startup_fails(tmp_path):
    from eagle3_assets.core.vllm_launcher import VLLMServer

    server = VLLMServer(tmp_path / "no-such-model", log_path=tmp_path / "log", startup_timeout_s=300)
    with pytest.raises(RuntimeError, match="exited with code"):
        server.start()
    assert server.process is not None and server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIG_DFL or 0)
