"""precision.param_dtype: 16-bit runs hold the parameters in the compute dtype and an fp32 master copy in
the optimizer state (split like the moments), as Megatron does; `fp32` keeps fp32 parameters and no copy.
Loads seed the copy, resumes convert between the two forms, readers of a checkpoint see the copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL
from layout_parity import BF16_GRAD_NORM_RTOL, BF16_LOSS_RTOL, PARITY, assert_same_run, run
from megajax.checkpoint.manager import CheckpointSource, find_step_dir, restore_params
from megajax.perf import analytic
from megajax.plan import make_plan
from megajax.precision.policy import precision_policy
from megajax.train.loop import build_trainer, train
from megajax.train.optimizer import master_of
from megajax.train.setup import build_setup

BF16 = ["train.precision=bf16"]
ZERO1 = "parallel.distributed_optimizer=true"


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _per_device(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
               if x.ndim > 0 and jnp.issubdtype(x.dtype, jnp.floating))


@pytest.mark.parametrize("overrides, params, master", [
    (BF16, "bfloat16", True), (["train.precision=fp16"], "float16", True), (["train.precision=fp8"], "bfloat16", True),
    ([*BF16, "precision.param_dtype=fp32"], "float32", False), (["train.precision=fp32"], "float32", False),
])
def test_the_state_holds_what_the_policy_says(small_config, overrides, params, master):
    setup = build_setup(make_plan(small_config(*overrides, "mesh.data=4", "mesh.tensor=2", ZERO1), 8))
    abstract = setup.abstract_state
    assert {x.dtype.name for x in jax.tree.leaves(abstract.params)} == {params}
    copy = master_of(abstract.opt_state)
    assert (copy is not None) == master == (precision_policy(setup.cfg).master_dtype is not None)
    if master:  # fp32, split over `data` like the moments (the parameters are not)
        assert {x.dtype.name for x in jax.tree.leaves(copy)} == {"float32"}
        q = setup.state_shardings.opt_state[-1].master["layers"]["attn"]["q"]["kernel"]
        assert q.spec == setup.state_shardings.opt_state[0].mu["layers"]["attn"]["q"]["kernel"].spec
        assert "data" in str(q.spec) and "data" not in str(setup.state_shardings.params["layers"]["attn"]["q"]["kernel"].spec)
    # The analytic figures count exactly the state's shards (Megatron's 2 + 4 + 12 / d in bf16).
    state = setup.fresh_state()
    est = analytic.memory_estimate(setup.plan, setup.spec)
    assert est["params"] == _per_device(state.params) and est["optimizer"] == _per_device(state.opt_state)
    if master:
        assert jax.tree.all(jax.tree.map(lambda p, m: bool(jnp.array_equal(p, m.astype(p.dtype))),
                                         state.params, master_of(state.opt_state)))


def test_bf16_parameters_on_an_uneven_distributed_optimizer_track_one_device(small_config):
    """bf16 with the copy split over data 3 (hidden 64 padded) x tensor 2 against one device's bf16 run;
    the parameters after step 1 read from the checkpoint are the fp32 copy."""
    batch = ["train.global_batch=12", *BF16]
    ref = run(small_config, "mesh.data=1", *batch, devices=jax.devices()[:1])
    got = run(small_config, "mesh.data=3", "mesh.tensor=2", ZERO1, *batch, devices=jax.devices()[:6])
    assert_same_run(got, ref, rtol=BF16_LOSS_RTOL, grad_norm_rtol=BF16_GRAD_NORM_RTOL, params_atol=1e-4)
    assert all(x.dtype == np.float32 for x in got.params1.values())
    # The copy, not its rounding: some parameter holds values bf16 cannot.
    assert any(not np.array_equal(x, x.astype(jnp.bfloat16).astype(np.float32)) for x in got.params1.values())


def test_resume_converts_between_the_forms(small_config, tmp_path):
    """An fp32-parameter checkpoint (precision.param_dtype=fp32, and every checkpoint written before the
    copy existed) resumes into a bf16 run with the copy, and back; readers see the copy."""
    fixed = [*PARITY, *BF16, "optim.decay_steps=4"]
    straight = train(small_config(*fixed, f"train.run_dir={tmp_path / 'straight'}", steps=4)).losses
    run_dir = f"train.run_dir={tmp_path / 'run'}"
    first = train(small_config(*fixed, run_dir, "precision.param_dtype=fp32", steps=2))
    saved = find_step_dir(tmp_path / "run")
    tr = build_trainer(small_config(*fixed, run_dir, steps=3))
    assert "fp32 parameters are the optimizer's master copy" in tr.origin
    for p, m, old in zip(_host(tr.state.params), _host(master_of(tr.state.opt_state)), _host(first.state.params)):
        np.testing.assert_array_equal(m, old)  # the saved fp32 parameters are the copy, bit for bit
        np.testing.assert_array_equal(p, old.astype(p.dtype))
    second = train(tr.cfg)
    # Steps 1-2 held fp32 parameters; the forward pass saw the same bf16 values, so the runs stay close.
    np.testing.assert_allclose(first.losses + second.losses, straight[:3], rtol=BF16_LOSS_RTOL)
    step3 = find_step_dir(tmp_path / "run")
    source = CheckpointSource(step3)  # exports read the fp32 copy
    copy = master_of(second.state.opt_state)
    np.testing.assert_array_equal(source.get("layers/attn/q/kernel"), np.asarray(copy["layers"]["attn"]["q"]["kernel"]))
    third = build_trainer(small_config(*fixed, run_dir, "precision.param_dtype=fp32", steps=4))
    assert "master parameters are the parameters" in third.origin and master_of(third.state.opt_state) is None
    for p, m in zip(_host(third.state.params), _host(copy)):
        np.testing.assert_array_equal(p, m)
    # A fine-tuning load and generation's load read the copy too (in the dtype asked for).
    tune = build_trainer(small_config(*BF16, f"train.run_dir={tmp_path / 'tune'}", f"checkpoint.load={step3}"))
    for m, want in zip(_host(master_of(tune.state.opt_state)), _host(copy)):
        np.testing.assert_array_equal(m, want)
    target = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.bfloat16, sharding=t.sharding),
                          tune.setup.logical_target().params)
    loaded, _ = restore_params(step3, target, tune.cfg)
    for x, want in zip(_host(loaded), _host(second.state.params)):
        np.testing.assert_array_equal(x, want)
    assert saved.name == "2"


def test_adapters_and_the_expert_bias_with_bf16_parameters(small_config, tmp_path):
    """LoRA adapters (the trainable parameters) in bf16 with their copy, the frozen base as it was; a MoE
    model's expert bias moves as before; both resume."""
    lora = small_config(*BF16, "model.lora.rank=4", f"train.run_dir={tmp_path / 'lora'}", steps=2)
    result = train(lora)
    assert {x.dtype.name for x in jax.tree.leaves(result.state.params)} == {"bfloat16"}
    assert {x.dtype.name for x in jax.tree.leaves(result.state.frozen)} == {"float32"}
    assert master_of(result.state.opt_state) is not None and np.isfinite(result.losses).all()
    again = build_trainer(small_config(*BF16, "model.lora.rank=4", f"train.run_dir={tmp_path / 'lora'}", steps=3))
    assert int(again.state.step) == 2
    moe = ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
           "model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=0.01",
           "model.moe_aux_loss_coeff=0"]
    moved = train(small_config(*BF16, *moe, "mesh.expert=2", "mesh.data=2", "mesh.fsdp=2",
                               f"train.run_dir={tmp_path / 'moe'}", steps=2))
    bias = np.asarray(moved.state.moe_expert_bias)
    assert bias.dtype == np.float32 and np.abs(bias).max() > 0


def test_a_wrong_param_dtype_is_one_clear_error(tmp_path):
    from test_bad_input import megajax, paragraph
    p = megajax("train", "precision.param_dtype=bf16", f"train.run_dir={tmp_path / 'run'}", "train.steps=1")
    paragraph(p, "train", "precision.param_dtype", "bf16", "compute", "fp32")
    assert not (tmp_path / "run").exists()
