"""The vLLM backend of hidden-state extraction, for targets too large for transformers.

vLLM's ``extract_hidden_states`` speculative method makes the target return
its residual stream at ``eagle_aux_hidden_state_layer_ids`` and caches it in a
"KV cache" of its own; the hidden-states KV connector writes each finished
request's states to ``<storage>/<request id>.safetensors`` (``hidden_states``
[T, n_ids, H], ``token_ids`` [T]) and reports the path in the request's
``kv_transfer_params``. Each trace is sent as a prompt of token ids with
``max_tokens=1``, so the states cover exactly the trace's tokens.

The ids asked of vLLM are the three aux ids plus ``L``: vLLM's id ``k`` is the
residual stream entering layer ``k`` (``hidden_states[k]`` of transformers,
equal to ~1e-7 here), and id ``L`` is the last layer's output *before* the
final norm. So this backend stores the final state ``pre_norm``; readers apply
the target's final norm before its ``lm_head`` (the sidecar says so), and the
training sees the same inputs as with the transformers backend.

The gate ``final_state_reproduces_logits`` compares the stored final states
with the engine's own greedy choice. Asked in a second pass, a bf16 MoE target
can route a token to other experts than in the pass that produced the states
(another batch, other rounding): the reference would then be another forward.
So the samples the gate will check are named before extraction
(:meth:`VLLMBackend.keep_references`), and their capture requests also ask for
prompt logprobs: vLLM computes them from the very hidden states the connector
writes, in the same step, in the engine's own precision.

On CPU the stock ``ExampleHiddenStatesConnector`` allocates pinned memory
for its asynchronous copy, which kills the engine; :class:`SyncHiddenStatesConnector`
copies synchronously there and defers to the stock code on GPUs.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    cleanup_hidden_states,
    extract_from_kv_cache,
)

from eagle3_assets.core.extraction.traces import TargetFacts, validate_layer_ids
from eagle3_assets.core.extraction.job import ExtractionRecipe
from eagle3_assets.core.serving.profile import MULTIPROCESSING_ENV, ServingProfile, VLLMLaunch, require_profile, vllm_launch

CONNECTOR_MODULE = __name__
CONNECTOR_CLASS = "SyncHiddenStatesConnector"
_MULTIPROCESSING_ENV = MULTIPROCESSING_ENV


class _CopyDone:
    """Stands in for the CUDA event the stock connector polls: a synchronous copy is done at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock hidden-states connector, with a synchronous copy and write when the cache is in CPU memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0]).clone()
        from safetensors.torch import save_file

        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock readers wait on
        self._req_copy_events[pending.req_id] = _CopyDone()


def extraction_launch(
    target_path: Path | str, engine_layer_ids: Sequence[int], scratch_dir: Path | str, serving: ServingProfile,
    *, context: int, seed: int = 0,
) -> VLLMLaunch:
    """The extraction engine's arguments: the target's serving profile (TP, quantization, dtype, CUDA graphs...), and what
    only this site adds: vLLM's hidden-states method at ``engine_layer_ids``, the connector that writes them, no prefix
    cache (a cached prefix is not recomputed, so its states would never reach the connector), no tokenizer."""
    site_args = {
        "enable_prefix_caching": False,
        "skip_tokenizer_init": True,
        "seed": seed,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(engine_layer_ids)}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(scratch_dir)},
        },
    }
    return vllm_launch(require_profile(serving, "extraction_launch(serving)"), target_path, context=context, site_args=site_args)


class VLLMBackend:
    """Hidden states through a vLLM engine in this process, at the configured ids plus ``L`` (pre-norm)."""

    name = "vllm"
    final_state = "pre_norm"

    def __init__(
        self,
        target_path: Path | str,
        aux_layer_ids: Sequence[int],
        recipe: ExtractionRecipe | None = None,
        *,
        max_model_len: int = 4096,
        max_batch_requests: int = 256,
        scratch_dir: Path | str | None = None,
        seed: int = 0,
        engine_in_process: bool | None = None,
        serving: ServingProfile,
    ):
        require_profile(serving, "VLLMBackend(serving=)")  # before vLLM's import and the scratch directory
        from vllm import LLM

        self.target_path = Path(target_path)
        facts = TargetFacts.from_path(self.target_path)
        self.num_layers = facts.num_layers
        self.hidden_size = facts.hidden_size
        self.aux_layer_ids = validate_layer_ids(aux_layer_ids, facts.num_layers)
        # vLLM returns the states in layer order; the final state is id L.
        self.engine_layer_ids = sorted(set(self.aux_layer_ids) | {facts.num_layers})
        recipe = recipe or ExtractionRecipe()  # batching: the stage's settings, with their one default
        self.max_batch_tokens = recipe.max_batch_tokens
        self.max_batch_requests = int(max_batch_requests)
        self._owns_scratch = scratch_dir is None
        self.scratch_dir = Path(scratch_dir or tempfile.mkdtemp(prefix="eagle3-vllm-hidden-states-"))
        self.scratch_dir.mkdir(parents=True, exist_ok=True)
        launch = extraction_launch(self.target_path, self.engine_layer_ids, self.scratch_dir, serving, context=max_model_len, seed=seed)
        self.max_model_len = int(launch.engine_args["max_model_len"])
        in_process = engine_in_process if engine_in_process is not None else launch.fast_start
        # In process: no engine-core process to spawn (and import vLLM in again), faster to start on a CPU host.
        # The variables are read when the engine is made and restored after, so servers started later are unaffected.
        environ_before = dict(os.environ)
        # An in-process CPU worker binds its threads and replaces torch.set_num_threads with a no-op
        # for as long as it lives; close() gives the process its own back.
        self._torch_threads = (torch.set_num_threads, torch.get_num_threads())
        # On a CPU host the launch bounds vLLM's KV cache (unset, it reserves most of the host's memory and refuses to
        # start beside other processes); extraction runs one prompt chunk at a time.
        os.environ.update(launch.environment(os.environ))
        os.environ[_MULTIPROCESSING_ENV] = "0" if in_process else "1"
        try:
            self.llm = LLM(**launch.engine_args)
        finally:
            # vLLM sets process-wide variables while it starts (LD_PRELOAD, thread and cache settings);
            # they are put back when the engine is closed, so that processes this one starts later
            # (a test session's vLLM server, other stages) do not inherit them.
            self._environ_changes = {
                key: environ_before.get(key) for key in set(environ_before) | set(os.environ) if environ_before.get(key) != os.environ.get(key)
            }
            _restore_environ({name: environ_before.get(name) for name in {_MULTIPROCESSING_ENV, *launch.env, *launch.env_defaults}})
        from vllm.v1.engine.core_client import InprocClient

        # With the engine core in this process nothing steps it between our calls, so the
        # connector's last writes wait for a step we drive; a separate core process steps itself.
        self._engine_in_process = isinstance(self.llm.llm_engine.engine_core, InprocClient)
        # The engine's greedy choice per position of the sequences the gate will check, from their capture pass.
        self._wanted_references: set[bytes] = set()
        self._same_pass_references: dict[bytes, torch.Tensor] = {}
        self.reference_passes = {"same_pass": 0, "separate_pass": 0}
        self.logits_dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    def keep_references(self, sequences: Sequence[Sequence[int]]) -> None:
        """Record the engine's argmax for these sequences in the pass that captures their states (for the gate)."""
        self._wanted_references = {_key(s) for s in sequences}
        self._same_pass_references.clear()

    # -- the backend protocol

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Chunks of requests for one ``generate`` call: no padding, bounded scratch space."""
        batches: list[list[int]] = []
        current: list[int] = []
        tokens = 0
        for position, length in enumerate(lengths):
            if current and (len(current) >= self.max_batch_requests or tokens + length > self.max_batch_tokens):
                batches.append(current)
                current, tokens = [], 0
            current.append(position)
            tokens += length
        if current:
            batches.append(current)
        return batches

    def capture(self, sequences: Sequence[Sequence[int]], dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from vllm import SamplingParams

        self._check_lengths(sequences)
        plain = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        with_reference = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
        keys = [_key(s) for s in sequences]
        outputs = self.llm.generate(
            [{"prompt_token_ids": _token_list(s)} for s in sequences],
            [with_reference if key in self._wanted_references else plain for key in keys],
            use_tqdm=False,
        )
        aux_columns = [self.engine_layer_ids.index(k) for k in self.aux_layer_ids]
        final_column = self.engine_layer_ids.index(self.num_layers)
        results = []
        for key, sequence, output in zip(keys, sequences, outputs):
            states = self._load(output)  # [T, n_ids, H]
            token_ids = states["token_ids"]
            if token_ids.tolist() != _token_list(sequence):
                raise RuntimeError(f"vLLM returned hidden states for {len(token_ids)} tokens that are not the {len(sequence)} sent")
            hidden = states["hidden_states"]
            aux = torch.cat([hidden[:, c] for c in aux_columns], dim=-1).to(dtype)
            results.append((aux, hidden[:, final_column].to(dtype)))
            if output.prompt_logprobs is not None:
                self._same_pass_references[key] = _greedy_choices(output)
        return results

    def reference_argmax(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The engine's own greedy choice after each position (for the gates), from vLLM's prompt logprobs.

        From the pass that captured the states where :meth:`keep_references`
        named the sequence; otherwise (a part kept from an interrupted run) from
        a pass of its own, counted in :attr:`reference_passes`.
        """
        from vllm import SamplingParams

        choices: dict[int, torch.Tensor] = {}
        separate = []
        for position, sequence in enumerate(sequences):
            recorded = self._same_pass_references.get(_key(sequence))
            if recorded is not None:
                choices[position] = recorded
            else:
                separate.append(position)
        self.reference_passes["same_pass"] += len(choices)
        self.reference_passes["separate_pass"] += len(separate)
        if separate:
            self._check_lengths([sequences[p] for p in separate])
            outputs = self.llm.generate(
                [{"prompt_token_ids": _token_list(sequences[p])} for p in separate],
                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False),
                use_tqdm=False,
            )
            for position, output in zip(separate, outputs):
                self._discard(output)
                choices[position] = _greedy_choices(output)
        return [choices[p] for p in range(len(sequences))]

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            _restore_environ(self._environ_changes)
            set_num_threads, threads = self._torch_threads
            torch.set_num_threads = set_num_threads
            set_num_threads(threads)
        if self._owns_scratch:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)

    # -- internals

    def _check_lengths(self, sequences: Sequence[Sequence[int]]) -> None:
        longest = max(len(s) for s in sequences)
        if longest + 1 > self.max_model_len:
            raise ValueError(f"a trace of {longest} tokens does not fit max_model_len {self.max_model_len} (needs {longest + 1})")

    def _load(self, output) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = (output.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(f"vLLM request {output.request_id}: no hidden_states_path (is the hidden-states connector configured?)")
        self._wait_written(path)
        try:
            return load_file(path)
        finally:
            cleanup_hidden_states(path)

    def _discard(self, output) -> None:
        path = (output.kv_transfer_params or {}).get("hidden_states_path")
        if path:
            self._wait_written(path)
            cleanup_hidden_states(path)

    def _wait_written(self, path: str, timeout_s: float = 600.0) -> None:
        """Until the connector released the file's lock (it holds it from scheduling until the write is done)."""
        lock = path + ".lock"
        deadline = time.monotonic() + timeout_s
        while True:
            if os.path.exists(lock):
                fd = os.open(lock, os.O_RDONLY)
                try:
                    if not self._engine_in_process:
                        fcntl.flock(fd, fcntl.LOCK_SH)  # sleeps until the writer releases it
                        return
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        return
                    except BlockingIOError:
                        pass
                finally:
                    os.close(fd)
            elif os.path.exists(path):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's hidden-states connector did not write {path} within {timeout_s:.0f}s")
            if self._engine_in_process:
                # Nothing else steps an in-process engine: one more step runs the connector's pending writes.
                self.llm.llm_engine.step()
            else:
                time.sleep(0.01)


def _restore_environ(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _greedy_choices(output) -> torch.Tensor:
    """The argmax after every position of a request's prompt (rank 1 of its prompt logprobs), then its greedy output token."""
    # Entry i is the distribution after token i-1 (entry 0, before the first token, is None).
    row = [next(t for t, logprob in entry.items() if logprob.rank == 1) for entry in output.prompt_logprobs[1:]]
    row.append(output.outputs[0].token_ids[0])
    return torch.tensor(row, dtype=torch.long)


def _key(sequence) -> bytes:
    return torch.as_tensor(_token_list(sequence), dtype=torch.int64).numpy().tobytes()


def _token_list(sequence) -> list[int]:
    return sequence.tolist() if isinstance(sequence, torch.Tensor) else [int(t) for t in sequence]
