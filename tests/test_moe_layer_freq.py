"""model.moe_layer_freq > 1: MoE layers alternate with dense ones (layer i is MoE when i % F == 0, as
in Megatron). The model equals its layers applied one by one; every expert-parallel layout trains as
one device does; checkpoints, generation and the Megatron-Core format keep the layer order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layout_parity import MOE, assert_same_run, moe_accumulation_reference, run
from megajax.config import load_config


def _tiny(*overrides):
    cfg = load_config(["model/tiny-moe"], ["model.vocab_size=100", "model.hidden_size=64", "model.num_heads=4",
                                           "model.ffn_hidden_size=128", "model.moe_ffn_hidden_size=32",
                                           "model.num_experts=4", *overrides])
    cfg.model.resolve(16)
    return cfg.model


@pytest.mark.parametrize("freq,num_layers", [(2, 4), (3, 6)])
def test_the_model_is_its_layers_in_megatron_order(freq, num_layers):
    from megajax.models.layout import layer_slots, param_shapes
    from megajax.models.transformer import Transformer
    m = _tiny(f"model.moe_layer_freq={freq}", f"model.num_layers={num_layers}")
    slots = layer_slots(m)
    assert [s == "layers/" for s, _ in slots] == [n % freq == 0 for n in range(num_layers)]
    assert m.num_moe_layers() == num_layers // freq
    shapes = param_shapes(m)
    assert shapes["layers/mlp/router"][0] == num_layers // freq
    assert shapes["dense_layers/mlp/gate/kernel"] == (num_layers - num_layers // freq, 64, 128)
    model = Transformer(m, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 100)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    logits, stats = nnx.jit(lambda mod, t: mod(t, router_stats=True))(model, tokens)
    assert stats.probs.shape[0] == num_layers // freq
    x = model.embed_input(tokens, positions, None)
    for stack, i in slots:  # each layer by hand, from its own stack, in model order
        graphdef, state = nnx.split(getattr(model, stack[:-1]))
        block = nnx.merge(graphdef, jax.tree.map(lambda p: p[i], state))
        x, _ = block(x, positions_BxL=positions, segment_ids_BxL=None, inv_freq=model.rope_inv_freq(),
                     dropout_rng=None)
    real = slice(0, 100)
    np.testing.assert_allclose(np.asarray(model.logits(x))[..., real], np.asarray(logits)[..., real],
                               rtol=1e-5, atol=1e-5)
    if freq != 2:
        return
    # Unrolled layers with full recompute: the same function of the same parameters.
    other = Transformer(_tiny(f"model.moe_layer_freq={freq}", f"model.num_layers={num_layers}",
                              "model.scan_layers=false"), recompute="full", rngs=nnx.Rngs(1))
    nnx.update(other, nnx.state(model, nnx.Param))
    grad = nnx.jit(nnx.grad(lambda mod: jnp.sum(mod(tokens)[..., real] ** 2)))
    g1, g2 = nnx.to_pure_dict(grad(model)), nnx.to_pure_dict(grad(other))
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda mod: mod(tokens))(other))[..., real],
                               np.asarray(logits)[..., real], rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g2)


# Layers 0 and 2 MoE (with a gated shared expert), 1 and 3 dense; the reference: one device, 2 microbatches
# of 4 sequences per step, 3 steps (moe_accumulation_reference, as the other MoE accumulation runs').
DENSE_BETWEEN = ["model.moe_layer_freq=2", "model.moe_shared_expert_ffn_size=48", "model.moe_shared_expert_gate=true"]


@pytest.mark.parametrize("mesh", [
    ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", "parallel.sequence_parallel=true"],
    ["mesh.pipeline=2", "mesh.data=2", "mesh.expert=2"],
], ids=["expert2_fsdp2_tensor2_sp", "1f1b_p2_data2_expert2"])
def test_interleaved_dense_layers_match_one_device(small_config, mesh):
    """Expert 2 x FSDP 2 x tensor 2 + SP (the shared expert's gate vector replicated, its MLP split over
    tensor), and 1F1B on pipeline 2 x data 2 x expert 2 (the stages split the groups [MoE layer,
    dense layer]: stage 0 holds model layers 0-1, stage 1 layers 2-3)."""
    ref = moe_accumulation_reference(small_config, *DENSE_BETWEEN)
    got = run(small_config, "model.num_layers=4", *MOE, *DENSE_BETWEEN, *mesh, "train.micro_batch=1",
              devices=jax.devices(), steps=3)
    assert_same_run(got, ref)
    assert any("dense_layers" in name for name in ref.params1)


def test_a_pipeline_stage_holds_whole_groups(small_config):
    """(The key's own errors are in tests/test_moe.py's list of MoE key errors.)"""
    from megajax.errors import MeshError
    from megajax.plan import make_plan
    with pytest.raises(MeshError, match=r"model.num_layers=4 with model.moe_layer_freq=2 is 2 groups .* "
                                        r"mesh.pipeline=4 x parallel.virtual_stages=1 must divide 2"):
        make_plan(small_config(*MOE, *DENSE_BETWEEN, "model.num_layers=4", "mesh.pipeline=4", "mesh.data=2",
                               "train.micro_batch=1"), 8)


def _random_model(*overrides):
    from megajax.checkpoint.source import flatten, unflatten
    from megajax.train.state import build_model_spec
    cfg = load_config(overrides=["model.num_layers=4", "model.hidden_size=32", "model.num_heads=4",
                                 "model.ffn_hidden_size=48", "model.vocab_size=257", "train.seq_len=32",
                                 "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=16",
                                 "model.moe_layer_freq=2", *overrides])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    rng = np.random.default_rng(0)
    flat = {name: (rng.normal(0.0, 0.1, x.shape) + name.endswith("/scale")).astype(np.float32)
            for name, x in flatten(spec.abstract_params)}
    flat["embed/embedding"][257:] = 0  # the vocabulary padding stays zero, as in training
    flat["output"][:, 257:] = 0
    return cfg, spec, unflatten(flat)


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_cached_generation_equals_the_full_forward(layer_buffers):
    """Greedy decoding with the KV cache (per-layer buffers in model order, or the stacked cache
    scanned in groups) gives the tokens of re-running the whole model, with the expert bias."""
    from megajax.inference.generate import Generator
    from megajax.inference.sampling import Sampling
    cfg, spec, params = _random_model("model.moe_router_score_function=sigmoid",
                                      "model.moe_router_bias_update_rate=0.01")
    bias = np.random.default_rng(1).normal(0.0, 0.3, (2, 4)).astype(np.float32)
    from test_moe_router_bias import greedy_by_full_forward
    prompt, n = [65, 66, 67, 68, 69], 6
    ids, _, _ = greedy_by_full_forward(spec, params, bias, prompt, n)
    gen = Generator(cfg.model, params, eod_id=None, layer_buffers=layer_buffers, expert_bias=bias)
    [done], _ = gen.generate([prompt], Sampling(), n)
    assert done.completion_ids == ids[len(prompt):]


def test_megatron_stages_round_trip_and_the_list_form_imports(tmp_path):
    """Pipeline stages of a Megatron export hold whole layers of either kind (numbered within the
    stage); the import merges them back exactly, also when args give the pattern as Megatron's list
    expression. Hugging Face (Mixtral: every layer MoE) refuses the model in one error."""
    import argparse
    torch = pytest.importorskip("torch")
    from megajax.checkpoint.common import model_overrides
    from megajax.checkpoint.hf import export_hf
    from megajax.checkpoint.megatron import export_megatron, import_megatron
    from megajax.checkpoint.source import DictSource, flatten
    from megajax.errors import CheckpointError
    cfg, _, params = _random_model("model.num_layers=6", "model.moe_layer_freq=3")
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=2, pipeline_parallel=3,
                          dtype="fp32", iteration=1)
    step = out / "iter_0000001"
    stage1 = torch.load(step / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)["model"]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in stage1  # model layer 2: dense
    assert "decoder.layers.1.mlp.router.weight" in stage1  # model layer 3: MoE
    for form in (3, "([1]+[0]*2)*2"):
        for t in range(2):
            for s in range(3):
                f = step / f"mp_rank_{t:02d}_{s:03d}" / "model_optim_rng.pt"
                saved = torch.load(f, weights_only=False)
                torch.save(dict(saved, args=argparse.Namespace(**dict(vars(saved["args"]), moe_layer_freq=form))), f)
        overrides, back = import_megatron(out)
        assert overrides == model_overrides(cfg.model) and overrides["moe_layer_freq"] == 3
        got, want = dict(flatten(back)), dict(flatten(params))
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    with pytest.raises(CheckpointError, match=r"moe_layer_freq=3 \(needs 1: every MixtralForCausalLM layer"):
        export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec="byte")
    assert not (tmp_path / "hf").exists()
