"""The environment variables of the embedded default (the built-in targets), declared as the platform's are.

:mod:`eagle3_assets.core.settings.environment` declares the platform's; these are the
demo's own, read through the same :class:`~eagle3_assets.core.settings.environment.Variable`
and listed with them in docs/configuration.md.
"""

from eagle3_assets.core.settings.environment import Variable

DEMO_TARGET = Variable("EAGLE3_DEMO_TARGET", "str", "tiny", "the built-in target `make demo` uses (`tiny`, `kimi`, `qwen3`, `long`: `make demo DEMO_TARGET=kimi`)")
TINY_TARGET_DIR = Variable(
    "EAGLE3_TINY_TARGET_DIR", "str", None, "where the built-in tiny target is cached (the tests use `.cache/`)", unset="`<data>/demo/tiny_target`"
)
KIMI_TARGET_DIR = Variable("EAGLE3_KIMI_TARGET_DIR", "str", None, "where the built-in Kimi-family target is cached", unset="`<data>/demo/kimi_target`")
QWEN3_TARGET_DIR = Variable("EAGLE3_QWEN3_TARGET_DIR", "str", None, "where the built-in Qwen3 target is cached", unset="`<data>/demo/qwen3_target`")
LONG_TARGET_DIR = Variable("EAGLE3_LONG_TARGET_DIR", "str", None, "where the built-in long-trace target is cached", unset="`<data>/demo/long_target`")
ACCEPT_TARGET_FINGERPRINT = Variable(
    "EAGLE3_ACCEPT_TARGET_FINGERPRINT",
    "bool",
    False,
    "`1`: use a built-in target whose greedy outputs differ from the recorded ones (`eagle3_assets/demo/target_fingerprints.json`)",
)
GPU_CHECK_FAULT = Variable("EAGLE3_GPU_CHECK_FAULT", "str", None, "fault injection for the tests: the `eagle3-gpu-check` path of that name fails")

DEMO_VARIABLES: tuple[Variable, ...] = (
    DEMO_TARGET, TINY_TARGET_DIR, KIMI_TARGET_DIR, QWEN3_TARGET_DIR, LONG_TARGET_DIR, ACCEPT_TARGET_FINGERPRINT, GPU_CHECK_FAULT,
)  # fmt: skip
