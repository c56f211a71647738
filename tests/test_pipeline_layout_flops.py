"""A stage's compiled products are those of its real layers: in a pipelined step whose stages hold
uneven numbers of layers, the FLOPs of each stage's own chunk work counted from the compiled program
(megajax bench's HLO matmul count, megajax/perf/hlo.py, by chunk branch and schedule table) are its
layers' count times one layer's, within 2 %: the padding rows of the stage form (the shorter stage
holds as many rows as the longest) compute nothing."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from conftest import SMALL
from megajax.config import load_config
from megajax.perf.bench import matmul_table
from megajax.plan import make_plan
from megajax.train.setup import build_setup


@functools.lru_cache(maxsize=None)
def _stage_layer_flops(*overrides: str) -> np.ndarray:
    """Each stage's own chunk-layer matmul FLOPs per step (per device) from the compiled step on the 8
    simulated devices (compiled, not run)."""
    cfg = load_config(overrides=[*SMALL, "train.micro_batch=1", *overrides])
    plan = make_plan(cfg, 8)
    setup = build_setup(plan, jax.devices())
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
    compiled = setup.train_step().lower(setup.target(), batch, ok).compile()
    table = matmul_table(plan, compiled, setup.flops_per_step / 8)
    return np.asarray(table["stage_layer_flops"])


@pytest.mark.parametrize("overrides, layers", [
    # 7 layers at pipeline 2, the first stage 3 (its stage form holds 4 rows, one of them padding)
    (["model.num_layers=7", "parallel.first_pipeline_stage_layers=3", "parallel.pipeline_schedule=gpipe"], [3, 4]),
    (["model.num_layers=7", "parallel.first_pipeline_stage_layers=3", "parallel.pipeline_schedule=1f1b"], [3, 4]),
    # 10 layers at pipeline 2 x 2 virtual stages, chunks 3, 2, 3, 2: stage 0 holds chunks 0 and 2
    (["model.num_layers=10", "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2",
      "parallel.pipeline_layout=Ettt|tt|ttt|ttL"], [6, 4]),
])
def test_each_stage_computes_only_its_real_layers(overrides, layers):
    got = _stage_layer_flops("mesh.pipeline=2", "mesh.data=4", *overrides)
    # One Llama layer's products per token, forward: q, k, v, o and the gated MLP's three, the attention
    # scores and their weighted sum (full, causal masking does not skip work); the backward twice that.
    h, q, kv, ffn, seq = 64, 64, 32, 128, 32  # SMALL
    forward = 2 * (h * (q + 2 * kv) + q * h + 3 * h * ffn) + 2 * 2 * seq * q
    tokens = 8 // 4 * seq  # the global batch over data 4, per device
    np.testing.assert_allclose(got, 3 * forward * tokens * np.asarray(layers), rtol=0.02)
    even = _stage_layer_flops("mesh.pipeline=2", "mesh.data=4", "model.num_layers=8")  # 4 + 4 layers
    np.testing.assert_allclose(even, 3 * forward * tokens * 4, rtol=0.02)


@pytest.mark.parametrize("overrides", [
    # 7 layers 3 + 4 at pipeline 2 x tensor 2 (+ SP) x data 2: the chunks' all-reduces / gathers per branch
    ["model.num_layers=7", "parallel.first_pipeline_stage_layers=3", "mesh.tensor=2", "mesh.data=2",
     "parallel.sequence_parallel=true"],
    # tiny-deepseek-v3 at pipeline 2 x 2 virtual stages x expert 2 x data 2, the dense layer alone first
    ["--preset-deepseek", "mesh.expert=2", "mesh.data=2", "parallel.pipeline_schedule=interleaved",
     "parallel.virtual_stages=2", "parallel.pipeline_layout=Et|t|t|mL"],
])
def test_the_compiled_collectives_of_uneven_chunks_are_the_analytic_ones(overrides):
    """Every collective kind of the compiled step within 0.9 - 1.1 of bench's analytic figure, which counts
    each distinct chunk's program once per tick as the compiled loop holds them."""
    from megajax.perf.bench import communication_table
    if overrides[0] == "--preset-deepseek":
        from test_deepseek_v3 import preset_overrides
        overrides = [*preset_overrides(), *overrides[1:]]
    cfg = load_config(overrides=[*SMALL, "train.micro_batch=1", "mesh.pipeline=2", *overrides])
    plan = make_plan(cfg, 8)
    setup = build_setup(plan, jax.devices())
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
    compiled = setup.train_step().lower(setup.target(), batch, ok).compile()
    comm = communication_table(plan, compiled, setup.spec)
    assert comm["total"]["bytes"] > 0
    for kind, row in comm.items():
        assert row["ratio"] is None or 0.9 <= row["ratio"] <= 1.1, (kind, row)
