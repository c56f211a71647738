"""Uneven and mixed pipeline stages (parallel.pipeline_layout, parallel.first/last_pipeline_stage_layers,
a hybrid pattern's irregular '|'): the layouts read as megatron-core reads them, every schedule and
axis computing the one-device function (loss and grad norm per step, fp32, rel 1e-5), each stage's
compiled products those of its real layers (no padded layer runs), and one clear error for a layout
that does not fit."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from layout_parity import assert_same_run, reference, run
from megajax.config import load_config
from megajax.errors import ConfigError, MeshError
from megajax.models.layer_plan import layer_plan, stage_plan
from megajax.pipeline_layout import StageLayout, layout_from_string, parse_layout, resolve_layout

STEPS = 3


# ----------------------------------------------------------------------------------------------
# The layout string, judged by megatron-core's own parser

MEGATRON_LAYOUTS = [
    # (layout, pipeline size, num_layers, mtp depths)
    ("Et*3|(tt|)*29,m|L", 16, 61, 1),
    ("Et*3|(tt|)*29,m|L", 8, 61, 1),
    ("Ettt|tt|ttt|ttL", 2, 10, 0),
    ("E|t*4,|(tt|)*1t*3L", 4, 9, 0),
    ("(Et|)*1(tt|)*2,ttmL", 2, 7, 1),
]


@pytest.mark.parametrize("text, pp, layers, mtp", MEGATRON_LAYOUTS)
def test_layout_strings_read_as_megatron_core_reads_them(text, pp, layers, mtp):
    """Each (pipeline rank, virtual stage)'s decoder layers and offsets, from megatron-core's
    PipelineParallelLayerLayout and from megajax's StageLayout, on the same strings."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    theirs = PipelineParallelLayerLayout(text, pp)
    assert ["".join(c) for c in parse_layout(text)] == [
        "".join({LayerType.embedding: "E", LayerType.loss: "L", LayerType.decoder: "t", LayerType.mtp: "m"}[x]
                for x in chunk) for chunk in PipelineParallelLayerLayout.parse_str_to_list(text)]
    vp = theirs.virtual_pipeline_model_parallel_size
    chunks = [c.count("t") for c in parse_layout(text)]
    ours = StageLayout(pp, vp, tuple(chunks), text)
    before = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)  # its per-chunk answers read it
    try:
        for s in range(pp):
            for v in range(vp):
                assert ours.chunks[ours.chunk(s, v)] == theirs.get_num_layers_to_build(vp_stage=v, pp_rank=s)
                assert ours.first_layer(ours.chunk(s, v)) == theirs.get_layer_offset(vp_stage=v, pp_rank=s)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(before)
    assert ours.megatron(mtp).replace(",", "") == ours.megatron(mtp)
    again = [c.count("t") for c in parse_layout(ours.megatron(mtp))]
    assert again == chunks  # megajax writes a layout Megatron reads back to the same chunks


def _megatron_split(pp: int, vp: int, layers: int, **kwargs) -> list[int]:
    """megatron-core's decoder layers per chunk (virtual-stage-major) for its uneven-split arguments."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vp if vp > 1 else None, pipeline_dtype=torch.float32,
                            **kwargs)
    return [get_num_layers_to_build(cfg, vp_stage=v if vp > 1 else None, pp_rank=s)
            for v in range(vp) for s in range(pp)]


@pytest.mark.parametrize("pp, vp, layers, keys, theirs", [
    (2, 1, 7, ["parallel.first_pipeline_stage_layers=3"], {"num_layers_in_first_pipeline_stage": 3}),
    (4, 1, 126, ["parallel.first_pipeline_stage_layers=30", "parallel.last_pipeline_stage_layers=30"],
     {"num_layers_in_first_pipeline_stage": 30, "num_layers_in_last_pipeline_stage": 30}),
    (4, 2, 30, ["parallel.last_pipeline_stage_layers=6"], {"num_layers_in_last_pipeline_stage": 6}),
    (8, 1, 126, ["parallel.account_for_embedding_in_pipeline_split=true",
                 "parallel.account_for_loss_in_pipeline_split=true"],
     {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}),
    (4, 2, 15, ["parallel.account_for_embedding_in_pipeline_split=true"],
     {"account_for_embedding_in_pipeline_split": True}),
])
def test_uneven_split_keys_split_as_megatron_core_does(pp, vp, layers, keys, theirs):
    sched = [f"parallel.virtual_stages={vp}", "parallel.pipeline_schedule=interleaved"] if vp > 1 else []
    cfg = load_config(["configs/model/tiny.yaml"], [f"model.num_layers={layers}", *keys, *sched])
    assert list(resolve_layout(cfg, pp, vp).chunks) == _megatron_split(pp, vp, layers, **theirs)


@pytest.mark.parametrize("text, words", [
    ("Ettt|tt|tL", ["names 3 chunks but this run has mesh.pipeline=2 x parallel.virtual_stages=1 = 2"]),
    ("Ett|ttt", ["the loss L must be named once, last in the last chunk"]),
    ("tEt|ttL", ["the embedding E must be named once, first in the first chunk"]),
    ("Ett|tttL", ["counts 5 decoder layers (t) but the model has 7"]),
    ("Ettx|tttL", ["'x' is not part of Megatron's layout syntax"]),
])
def test_a_layout_that_does_not_fit_is_one_error(text, words):
    cfg = load_config(["configs/model/tiny.yaml"], ["model.num_layers=7"]) if "x" not in text else None
    with pytest.raises((MeshError, ConfigError)) as e:
        if cfg is None:
            load_config(["configs/model/tiny.yaml"], ["model.num_layers=7", f"parallel.pipeline_layout={text}"])
        else:
            layout_from_string(text, cfg.model, 2, 1)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert "parallel.pipeline_layout" in str(e.value)


def test_the_stage_form_pads_only_where_a_stage_has_fewer_layers():
    """Llama 3.1 405B (126 layers) at pipeline 8 x 8 virtual stages, E and L each counted as a layer
    (Megatron-Bridge's recipe): 64 chunks of 2, the first and last of 1: each stage's 16 rows hold 16 or
    15 layers. DeepSeek-V3's 3 dense layers in its first chunk: 3 rows per stage, the 58 MoE layers 8."""
    cfg = load_config(["configs/model/tiny.yaml"], ["model.num_layers=126"])
    cfg.parallel.account_for_embedding_in_pipeline_split = cfg.parallel.account_for_loss_in_pipeline_split = True
    layout = resolve_layout(cfg, 8, 8)
    sp = stage_plan(layer_plan(cfg.model), layout.chunks, 8, 8)
    assert sp.kinds[0].stage_rows == 16 and sp.padding_layers() == 2 and len(sp.branches) == 2
    dsv3 = load_config(["configs/model/deepseek-v3.yaml"], [])
    layout = layout_from_string("Et*3|(tt|)*29|L", dsv3.model, 8, 4)
    sp = stage_plan(layer_plan(dsv3.model), layout.chunks, 8, 4)
    dense, moe = sp.kinds
    assert (dense.stage_rows, moe.stage_rows, moe.window) == (3, 8, 2)


# ----------------------------------------------------------------------------------------------
# Every schedule and axis against one device

LLAMA7 = ["model.num_layers=7", "train.micro_batch=2"]
LLAMA10 = ["model.num_layers=10", "train.micro_batch=2"]
FIRST3 = ["mesh.pipeline=2", "mesh.data=1", "parallel.first_pipeline_stage_layers=3"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_first_stage_of_three_layers_matches_one_device(small_config, schedule):
    ref = reference(small_config, *LLAMA7, steps=STEPS)
    got = run(small_config, *LLAMA7, *FIRST3, f"parallel.pipeline_schedule={schedule}", devices=jax.devices()[:2],
              steps=STEPS)
    assert_same_run(got, ref)


def test_layout_string_with_interleaved_uneven_chunks_matches_one_device(small_config):
    """10 layers at pipeline 2 x 2 virtual stages, chunks of 3, 2, 3, 2 layers with E and L."""
    ref = reference(small_config, *LLAMA10, steps=STEPS)
    got = run(small_config, *LLAMA10, "mesh.pipeline=2", "mesh.data=1", "parallel.pipeline_schedule=interleaved",
              "parallel.virtual_stages=2", "parallel.pipeline_layout=Ettt|tt|ttt|ttL", devices=jax.devices()[:2],
              steps=STEPS)
    assert_same_run(got, ref)


def test_context_ring_and_fsdp_through_uneven_stages_match_one_device(small_config):
    """The 7 layers split 3 + 4 over pipeline 2 x context 2 (ring) x fsdp 2."""
    ref = reference(small_config, *LLAMA7, steps=STEPS)
    got = run(small_config, *LLAMA7, *FIRST3, "mesh.context=2", "mesh.fsdp=2", "parallel.context_impl=ring",
              devices=jax.devices(), steps=STEPS)
    assert_same_run(got, ref)


def test_fp8_through_uneven_stages_tracks_one_device_fp8(small_config):
    """FP8 (delayed scaling) on the 3 + 4 split: the stacks' scales ride into the stage form and their
    amaxes back out; loss and grad norm per step against one device's FP8 run, within
    tests/test_fp8_training.py's tolerances."""
    from test_fp8_training import FP8_GRAD_NORM_RTOL, FP8_LOSS_RTOL
    fp8 = [*LLAMA7, "train.precision=fp8"]
    ref = reference(small_config, *fp8, steps=STEPS, params=False)
    got = run(small_config, *fp8, *FIRST3, devices=jax.devices()[:2], steps=STEPS, params=False)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=2 * FP8_LOSS_RTOL)
    np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=FP8_GRAD_NORM_RTOL)


def test_deepseek_v3_dense_layer_alone_first_and_mtp_with_the_loss_matches_one_device(small_config):
    """tiny-deepseek-v3 (a dense layer, two MoE layers, one MTP depth) at pipeline 2 x 2 virtual stages x
    expert 2: chunk 0 holds E and the dense layer, chunks 1 and 2 a MoE layer each, chunk 3 the MTP
    depth and L (no decoder layer)."""
    from test_deepseek_v3 import preset_overrides
    model = preset_overrides()
    ref = reference(small_config, *model, "train.micro_batch=2", steps=STEPS, params=False)
    got = run(small_config, *model, "mesh.pipeline=2", "mesh.expert=2", "mesh.data=1", "train.micro_batch=1",
              "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2",
              "parallel.pipeline_layout=Et|t|t|mL", devices=jax.devices()[:4], steps=STEPS, params=False)
    assert ref.mtp_losses is not None
    assert_same_run(got, ref, params=False)
    np.testing.assert_allclose(got.mtp_losses, ref.mtp_losses, rtol=1e-5)


def test_hybrid_with_irregular_stages_matches_one_device(small_config):
    """tiny-hybrid-like 'M*-EM|*-E' (5 layers, then 3) at pipeline 2 x tensor 2 + sequence parallelism."""
    from test_hybrid import HYBRID
    model = [o for o in HYBRID if "pattern" not in o] + ["model.hybrid_layer_pattern=M*-EM|*-E"]
    ref = reference(small_config, *model, "train.micro_batch=1", steps=STEPS)
    got = run(small_config, *model, "mesh.pipeline=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
              "mesh.data=1", "train.micro_batch=1", devices=jax.devices()[:4], steps=STEPS)
    assert_same_run(got, ref)
