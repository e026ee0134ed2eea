"""Dagster-free logic: every function here is importable and testable without an instance.

One subpackage per domain, one concern per module (``core/<domain>/<module>.py``); the
packages re-export nothing, so an import names the module that holds what it imports:

- ``prompts``: reading a prompt dataset a shard at a time: sources, indexes, normalised records, held-out prompts.
- ``generation``: regenerating the target's responses through an OpenAI-compatible server (vLLM, SGLang), resumably.
- ``validation``: keeping or rejecting each raw response, rendering the kept ones into the target's tokens, and the gates.
- ``target``: the target model as every stage sees it: its description, identity, tokenizer, head, pre-flight and serving.
- ``extraction``: the target's hidden states for EAGLE-3: extracted exactly, streamed to disk, resumable, checked.
- ``draft``: the EAGLE-3 draft model in vLLM's native form, its vocabulary, and its export.
- ``evaluation``: the draft's acceptance, measured through vLLM speculative decoding, and the depth to deploy.
- ``serving``: vLLM servers: starting them, reading their metrics, the deployed draft and watching it in production.
- ``gpu_host``: running the GPU stages on the GPU host: the pre-flight, the stage lock, the jobs, the remote shell.
- ``storage``: where the assets' files live and how they are written: atomically, journaled, leased, verified.
- ``settings``: typed settings: pydantic models whose fields carry their one default and their description, and the environment variables, each declared once.
- ``reporting``: what the assets show: a gate's outcome, plots as markdown.
- ``orchestration``: driving the Dagster instance from outside it: backfills of chosen shards.
- ``training``: training the draft on stored hidden states: the loop, its data, checkpoints, schedule, bounded-disk mode.
"""
