"""The run plan: the pipeline choice, the checks read from the rules tables, variants re-checked."""

import dataclasses

import pytest

from megajax.errors import MeshError
from megajax.mesh import model_dims
from megajax.plan import PipelineChoice, make_plan


def test_pipeline_choice_is_the_plans(small_config):
    plan = make_plan(small_config("mesh.pipeline=2", "mesh.data=4", "train.global_batch=16", "train.micro_batch=2"), 8)
    assert plan.pipeline == PipelineChoice(schedule="1f1b", stages=2, virtual_stages=1, microbatches=2)
    assert plan.pipeline.microbatches == plan.batch.accumulation
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pipeline.stages = 4
    assert make_plan(small_config("mesh.data=8"), 8).pipeline is None


def test_divisibility_follows_the_rules_tables(small_config):
    """Which size must divide which comes from the rules: `heads` over mesh.tensor must divide; the
    stored state's data-parallel splits (`embed` over mesh.fsdp for the parameters, with the
    distributed optimizer over mesh.data x mesh.fsdp for the optimizer state) need not: they are
    padded (tests/test_optimizer_sharding.py)."""
    cfg = small_config("model.hidden_size=48", "model.num_heads=8", "model.num_kv_heads=4", "mesh.data=8")
    assert make_plan(cfg, 8).batch.data_parallel == 8  # embed is not split over data: fine
    assert make_plan(small_config("model.hidden_size=48", "mesh.data=1", "mesh.fsdp=32",
                                  "train.global_batch=32"), 32).sizes["fsdp"] == 32
    assert make_plan(small_config("model.hidden_size=48", "mesh.data=32", "parallel.distributed_optimizer=true",
                                  "train.global_batch=32"), 32).sizes["data"] == 32
    with pytest.raises(MeshError, match=r"model.num_heads=8 is not divisible by mesh.tensor=16"):
        make_plan(small_config("mesh.data=1", "mesh.tensor=16", "model.num_kv_heads=4"), 16)
    # The vocabulary over mesh.tensor keeps its own hint.
    with pytest.raises(MeshError, match=r"mesh.tensor=8 does not divide the padded vocabulary 260"):
        make_plan(small_config("model.vocab_size=260", "model.make_vocab_size_divisible_by=4", "mesh.tensor=8", "model.num_kv_heads=8",
                               "mesh.data=1"), 8)


def test_model_dims_name_the_config_keys(small_config):
    dims = model_dims(small_config("model.num_experts=4", "model.moe_ffn_hidden_size=32"))
    assert dims["experts"] == [("model.num_experts", 4)]
    assert dims["expert_mlp"] == [("model.moe_ffn_hidden_size", 32)] and dims["heads"] == [("model.num_heads", 8)]
    assert ("model.moe_ffn_hidden_size", 32) not in dims["mlp"]  # the experts' own axis (MoE parallel folding)
    assert "experts" not in model_dims(small_config())


def test_a_variant_is_checked_like_a_plan(small_config):
    plan = make_plan(small_config("mesh.data=8"), 8)
    alt = dataclasses.replace(plan.cfg.train, micro_batch=3)
    cfg = dataclasses.replace(plan.cfg, train=alt)
    with pytest.raises(MeshError, match="train.micro_batch=3"):
        plan.variant(cfg)
    tp = plan.variant(plan.cfg, {**plan.ici, "data": 2, "tensor": 4})
    assert tp.sizes["tensor"] == 4 and tp.batch.data_parallel == 2 and tp.batch.micro_batch == 4
