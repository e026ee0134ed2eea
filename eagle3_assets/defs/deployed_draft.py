"""``deployed_draft``: the draft as it runs on the production servers, known only by observation.

Nothing here materialises it: the platform does not deploy (the serving
command is in the exported draft's ``SERVING.md``). The sensor
``deployed_draft_watch`` scrapes the production servers every few minutes and
records one observation per server and window: acceptance length and
per-position rates over the window, drafts and tokens counted, which draft the
server serves against the latest ``draft_checkpoint``, and the offline figure
it is held to. In the UI its numeric metadata plot as series over time, which
is how a fall in acceptance (traffic that moved away from the training
prompts) shows before anyone has to ask.

An external asset, downstream of ``draft_checkpoint`` and ``draft_evaluation``
so that the graph reads train -> evaluate -> deploy.
"""

from dagster import AssetKey, AssetSpec

deployed_draft = AssetSpec(
    "deployed_draft",
    deps=[AssetKey("draft_checkpoint"), AssetKey("draft_evaluation")],
    group_name="production",
    kinds={"vllm"},
    description=(
        "The draft the production servers run (EAGLE3_PRODUCTION_URLS), observed by the sensor deployed_draft_watch: "
        "windowed acceptance from vLLM's spec-decode counters, which draft each server serves, alerts on drops."
    ),
)
