"""Low-rank adapters (model.lora): every layout computes the one-device function (loss and grad norm
per step, the adapters after step 1; fp32, rel 1e-5), the base stays frozen with no optimizer state,
and checkpoints hold the adapters alone."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from layout_parity import MOE, assert_same_run, reference, run
from test_hybrid import HYBRID

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
# A hybrid 'M*-E' model's every linear but the experts': the Mamba mixers' in_proj (one A over z, x, B,
# C, dt; B split by groups over tensor) and out_proj (row-parallel), attention's and the MLP's.
HYBRID_LORA = [*HYBRID, "model.lora.targets=[in_proj,out_proj,qkv,proj,fc1,fc2]"]
# layout -> (the model's overrides, the layout's)
LAYOUTS = {
    "data2_fsdp2_tensor2": ([], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    "tensor4_sp_data2": ([], ["mesh.tensor=4", "parallel.sequence_parallel=true", "mesh.data=2"]),
    "pipeline2_tensor2_sp_data2": ([], ["mesh.pipeline=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                        "mesh.data=2", "train.micro_batch=2"]),
    "expert2_data4_moe": ([*MOE, "model.moe_layer_freq=2"], ["mesh.expert=2", "mesh.data=4"]),
    # The routed experts' adapters (`experts`), split over expert 2 with their kernels (mlp over tensor 2).
    "expert2_tensor2_sp_data2_moe_experts": ([*MOE, "model.moe_layer_freq=2",
                                              "model.lora.targets=[qkv,proj,fc1,fc2,experts]"],
                                             ["mesh.expert=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                              "mesh.data=2"]),
    # The reference's microbatch: data-parallel size x the layout's (the balancing loss counts a microbatch).
    "hybrid_tensor2_sp_data4": ([*HYBRID_LORA, "model.lora.dropout=0.1"],
                                ["mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.data=4",
                                 "train.micro_batch=2", "reference:train.micro_batch=8"]),
    "hybrid_pipeline2_expert2_context2": (HYBRID_LORA, ["mesh.pipeline=2", "mesh.expert=2", "mesh.context=2",
                                                        "train.micro_batch=1", "reference:train.micro_batch=2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_lora_layouts_match_one_device(small_config, layout):
    model, overrides = LAYOUTS[layout]
    own = [o[len("reference:"):] for o in overrides if o.startswith("reference:")]
    overrides = [o for o in overrides if not o.startswith("reference:")]
    micro = own or [o for o in overrides if o.startswith("train.micro_batch")]
    ref = reference(small_config, *LORA, *model, *micro)
    got = run(small_config, *LORA, *model, *overrides, devices=jax.devices())
    assert_same_run(got, ref)


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_base_is_frozen_without_optimizer_state_and_compiled_memory_shrinks(small_config):
    """The optimizer state holds adapter-sized arrays only; the compiled step's arguments (the state)
    and temporaries are smaller than full training's of the same model."""
    from megajax.train.setup import build_trainer
    full = build_trainer(small_config(steps=1), jax.devices()[:1])
    tr = build_trainer(small_config(*LORA, steps=1), jax.devices()[:1])
    state = tr.state
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(state.params))
    assert adapter_shapes and all(p[-1] in ("a", "b") for p in
                                  (tuple(getattr(k, "key", k) for k in path)
                                   for path, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sorted(x.shape for x in moments) == sorted(adapter_shapes * 2)  # Adam's mu and nu, adapters only
    assert _bytes(state.frozen) == _bytes(full.state.params)  # the whole base, held once, no gradient
    lora_mem, full_mem = tr.step_fn.memory_analysis(), full.step_fn.memory_analysis()
    print(f"compiled memory, small llama, one device: full training arguments {full_mem.argument_size_in_bytes} B, "
          f"temporaries {full_mem.temp_size_in_bytes} B; LoRA rank 4 arguments {lora_mem.argument_size_in_bytes} B, "
          f"temporaries {lora_mem.temp_size_in_bytes} B; optimizer state {_bytes(full.state.opt_state)} -> "
          f"{_bytes(state.opt_state)} B")
    assert _bytes(state.opt_state) < _bytes(full.state.opt_state) / 10
    assert lora_mem.argument_size_in_bytes < full_mem.argument_size_in_bytes / 2
    assert lora_mem.temp_size_in_bytes < full_mem.temp_size_in_bytes


def test_lora_checkpoint_holds_adapters_only_and_resumes_bitwise(small_config, tmp_path, monkeypatch):
    import shutil
    from pathlib import Path
    from megajax.checkpoint.manager import CheckpointSource, read_meta, stored_arrays
    from megajax.train.loop import train
    monkeypatch.chdir(tmp_path)
    fixed = ["optim.decay_steps=4", "optim.lr=1e-2"]
    base = train(small_config(*fixed, "train.run_dir=base", steps=2))
    tuned = [*LORA, *fixed, "checkpoint.load=base"]
    full = train(small_config(*tuned, "train.run_dir=full", steps=4))
    train(small_config(*tuned, "train.run_dir=part", "checkpoint.every=2", steps=2))
    resumed = train(small_config(*tuned, "train.run_dir=part", steps=4))
    np.testing.assert_array_equal(resumed.losses, full.losses[2:])
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(full.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    step_dir = Path("part/checkpoints/4")
    names = sorted(stored_arrays(step_dir)[0])
    params = [n for n in names if n.startswith("params.")]
    assert params and all(n.split(".")[-2] in ("lora", "qkv_lora", "gate_up_lora") for n in params), params
    assert not any("kernel" in n or "embedding" in n for n in names), names
    ref = read_meta(step_dir)["lora_base"]
    assert Path(ref["path"]) == (tmp_path / "base/checkpoints/2") and len(ref["files_sha256"]) == 64

    def size(d):
        return sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())
    lora_size, full_size = size(step_dir), size("base/checkpoints/2")
    print(f"checkpoint sizes: full model with Adam state {full_size} B, LoRA rank 4 adapters with theirs {lora_size} B")
    assert lora_size < full_size / 3
    assert CheckpointSource(step_dir).model.lora.rank == 4

    # Resuming without the base is refused, naming it.
    shutil.move("base", "elsewhere")
    with pytest.raises(Exception, match="frozen base model .*base/checkpoints/2 does not exist"):
        train(small_config(*tuned, "train.run_dir=part", steps=5))


def test_lora_dropout_and_fp8_base(small_config):
    """The adapters' input dropout draws one device's masks on tensor 2 (SP) x data 4; with
    train.precision=fp8 the base products are FP8 and the adapters train in the compute dtype."""
    drop = [*LORA, "model.lora.dropout=0.1"]
    ref = reference(small_config, *drop)
    got = run(small_config, *drop, "mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.data=4",
              devices=jax.devices())
    assert_same_run(got, ref)
    assert not np.allclose(ref.losses, reference(small_config, *LORA).losses)  # the dropout is on
    fp8 = run(small_config, *LORA, "train.precision=fp8", devices=jax.devices()[:1], steps=3, params=False)
    assert np.all(np.isfinite(fp8.losses)) and fp8.losses[-1] < fp8.losses[0]


def test_analytic_memory_counts_the_frozen_base_without_gradients_or_adam_state(small_config):
    """bench's analytic memory with model.lora: parameters = the frozen base + the adapters, each as the
    devices hold them; gradients and Adam state the adapters' alone (checked against the state's arrays)."""
    import jax.numpy as jnp
    from megajax.perf import analytic
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    cfg = small_config("model.lora.rank=4", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2")
    setup = build_setup(make_plan(cfg, 8))
    est, state = analytic.memory_estimate(setup.plan, setup.spec), setup.fresh_state()

    def per_device(tree):
        leaves = [x for x in jax.tree.leaves(tree) if x.ndim > 0 and jnp.issubdtype(x.dtype, jnp.floating)]
        return sum(x.addressable_shards[0].data.nbytes for x in leaves)

    assert state.frozen is not None and per_device(state.frozen) > 5 * per_device(state.params)
    assert est["params"] == per_device(state.frozen) + per_device(state.params)
    assert est["grads"] == per_device(state.params) and est["optimizer"] == per_device(state.opt_state)


@pytest.mark.parametrize("overrides, match", [
    (["model.lora.targets=[in_proj]"], r"model.lora.targets = \['in_proj'\]: unknown or repeated targets \['in_proj'\]; "
                                       r"this model's linears are qkv, proj, fc1, fc2 "),
    (["model.lora.targets=[fc1,experts]"], r"unknown or repeated targets \['experts'\]; this model's linears are "
                                            r"qkv, proj, fc1, fc2 "),
    ([*MOE, "model.lora.targets=[experts]", "model.lora.dropout=0.1"],
     r"model.lora.dropout = 0.1 with the `experts` target: .* set model.lora.dropout=0 or drop `experts`"),
    ([*HYBRID, "model.hybrid_layer_pattern=M-M-", "model.lora.targets=[in_proj,qkv]"],
     r"unknown or repeated targets \['qkv'\]; this model's linears are fc1, fc2, in_proj, out_proj "),
    ([*HYBRID, "model.hybrid_layer_pattern=MM", "model.num_experts=0"],  # the default targets
     r"unknown or repeated targets \['qkv', 'proj', 'fc1', 'fc2'\]; this model's linears are in_proj, out_proj "),
    ([*HYBRID, "model.lora.targets=[experts,linear_qkv,qkv]"],
     r"unknown or repeated targets \['experts', 'linear_qkv', 'qkv'\]; this model's linears are qkv, proj, fc1, fc2, "
     r"in_proj, out_proj, experts "),
])
def test_lora_targets_the_model_lacks_are_one_error(small_config, overrides, match):
    from megajax.errors import ConfigError
    with pytest.raises(ConfigError, match=match):
        small_config(*LORA, *overrides)
