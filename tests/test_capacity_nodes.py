"""The capacity plan on N nodes of a Ray cluster: extraction over one engine per node, training over nnodes, generation unchanged.

Pure arithmetic on made-up shards (no Dagster, no Ray): each test names the mutation of
``core/planning/capacity.py`` it fails on.
"""

import pytest

from eagle3_assets.core.planning.capacity import PlanSettings, ShardFacts, Volume, plan_capacity, plan_nodes
from eagle3_assets.core.planning.stage_rates import Rate, training_epochs

DISK = Volume("GPU host", "/data", 10**15)
RATES = {"generation": Rate(50.0, "configured"), "extraction": Rate(1000.0, "configured"), "training": Rate(1000.0, "configured")}


def shards(count: int, tokens: int) -> list[ShardFacts]:
    return [ShardFacts(f"shard-{i:05d}", 10, validated_tokens=tokens) for i in range(count)]


def plan(count: int = 100, tokens: int = 10_000, **settings):
    return plan_capacity(shards(count, tokens), PlanSettings(hidden_size=64, epochs=10, **settings), DISK, DISK, RATES)


def test_extraction_divides_over_the_nodes_engines_and_each_engine_loads_the_target_once_per_run():
    """100 shards of 10,000 tokens, runs of 20, 4 nodes, a 600 s load: 5 runs of (600 s + 200,000 tokens / 1,000 tokens/s / 4).

    Fails on the mutations of ``extraction_wall_hours``: the tokens not divided over the engines (``/ settings.extraction_gpus``
    alone), the load paid once per engine in wall time (``load_s * engines``), the loads' GPU time once per run (``* engines``
    dropped), and the load left out (``load_s = 0.0``).
    """
    four = plan(nodes=4, shards_per_run=20, target_load_s=600.0)
    assert four.hours["extraction"] == pytest.approx(5 * (600 + 200_000 / 1000 / 4) / 3600)
    # GPU time: every token once at the per-GPU rate, plus 5 runs x 4 engines x 600 s of loading.
    assert four.gpu_hours["extraction"] == pytest.approx((1_000_000 / 1000 + 5 * 4 * 600) / 3600)
    one = plan(nodes=1, shards_per_run=20, target_load_s=600.0)
    assert one.hours["extraction"] == pytest.approx(5 * (600 + 200_000 / 1000) / 3600)
    assert one.gpu_hours["extraction"] == pytest.approx((1_000_000 / 1000 + 5 * 600) / 3600)
    assert "| extraction | 1,000 | configured | 4 |" in four.markdown() and four.as_metadata()["nodes"]["extraction"] == 4


def test_a_run_of_fewer_shards_than_nodes_uses_only_as_many_engines():
    """Runs of 2 shards on 4 nodes build 2 engines each (never more than the run's shards): the tokens divide by 2, and 2
    engines load. Fails on the mutation ``engines = max(1, settings.nodes)`` (the ``min`` with the run's shards dropped)."""
    p = plan(count=10, nodes=4, shards_per_run=2, target_load_s=100.0)
    assert p.hours["extraction"] == pytest.approx(5 * (100 + 20_000 / 1000 / 2) / 3600)
    assert p.gpu_hours["extraction"] == pytest.approx((100_000 / 1000 + 5 * 2 * 100) / 3600)


def test_training_divides_over_its_nodes_gpus_and_fits_its_epochs_to_that_world():
    """300,000 tokens at H = 7,168: the schedule fits 11 epochs on 8 ranks and 22 on 16, so the world size shows in the epochs.

    Fails on the mutations: the world size without the nodes (``training_world = settings.training_gpus``), and
    ``training_nodes`` ignored (``PlanSettings.nodes_training`` returning ``self.nodes``).
    """
    settings = dict(hidden_size=7168, training_gpus=8)
    two = plan_capacity(shards(30, 10_000), PlanSettings(nodes=2, **settings), DISK, DISK, RATES)
    assert two.epochs == training_epochs(300_000, 7168, 16) == 22 != training_epochs(300_000, 7168, 8)
    assert two.gpu_hours["training"] == pytest.approx(300_000 * 22 / 1000 / 3600)
    assert two.hours["training"] == pytest.approx(two.gpu_hours["training"] / 16)
    assert any("DDP assumed to scale linearly" in line for line in two.assumed)
    # Extraction on 4 nodes, training on 1 (draft_checkpoint's nnodes left at 1): 8 ranks, 11 epochs, nothing assumed of DDP.
    apart = plan_capacity(shards(30, 10_000), PlanSettings(nodes=4, training_nodes=1, **settings), DISK, DISK, RATES)
    assert apart.epochs == 11 and apart.hours["training"] == pytest.approx(300_000 * 11 / 1000 / 3600 / 8)
    assert not any("DDP" in line for line in apart.assumed)


def test_generation_is_the_servers_whatever_the_nodes():
    """Generation goes to the vLLM URLs, not the cluster's nodes. Fails on the mutation that divides its hours by ``nodes``."""
    one, four = plan(nodes=1), plan(nodes=4)
    assert four.hours["generation"] == one.hours["generation"] == pytest.approx(1_000_000 / 50 / 3600)
    assert four.gpu_hours["generation"] == one.gpu_hours["generation"]


def test_target_loads_not_counted_are_said():
    """Fails on the mutation that drops the note of ``node_assumptions`` when ``target_load_s`` is unset."""
    assert any("target loads not counted" in line for line in plan().assumed)
    assert not any("target loads" in line for line in plan(target_load_s=60.0).assumed)
    assert "target loads not counted" in plan().markdown()


def test_the_node_count_comes_from_the_config_else_the_ray_hosts_engines_else_one():
    """Fails on the mutations of ``plan_nodes``: ``ray_engines`` taken on a host that is not a Ray cluster (the
    ``host_mode == "ray"`` test dropped), the configured count not winning, and either note dropped."""
    assert plan_nodes(None, "local", 0) == (1, None)
    assert plan_nodes(None, "ssh", 3) == (1, None)
    assert plan_nodes(None, "ray", 3) == (3, None)
    assert plan_nodes(2, "ray", 3) == (2, None)
    nodes, note = plan_nodes(None, "ray", 0)
    assert nodes == 1 and "set capacity_plan's nodes" in note
    nodes, note = plan_nodes(4, "local", 0)
    assert nodes == 4 and "what-if" in note
