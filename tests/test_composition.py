"""Composition: the combinations of axes, kernels and features that large Megatron runs use, each
against one device (loss and grad norm per step, parameters after step 1; fp32, rel 1e-5).

Inside the pipeline the stage loop is manual over every mesh axis (megajax/parallel/pipeline.py):
tensor and sequence parallelism, context parallelism (ring and all-gather), the fused attention
kernels and the expert dispatch run there as the same explicit collectives as outside it, and every
device joins every collective of a tick (a stage without work of its own computes on zeros).
"""

import jax
import pytest

from layout_parity import MOE, assert_same_run, moe_accumulation_reference, reference, run

MODEL = ["model.num_layers=4"]
REFERENCE = [*MODEL, "train.micro_batch=2"]  # one device, 4 microbatches of 2 (the pipeline runs' split)


def test_pipeline_tensor_sequence_parallel_with_flash_attention(small_config):
    """1F1B on pipeline 2 x data 2 x tensor 2 with sequence parallelism and the Pallas flash kernel:
    each device runs the kernel on its heads inside the stage (Megatron's TP x PP + SP + fused
    attention)."""
    ref = reference(small_config, *REFERENCE, "model.attention_impl=flash")
    got = run(small_config, *MODEL, "mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "train.micro_batch=1",
              "parallel.sequence_parallel=true", "model.attention_impl=flash", devices=jax.devices())
    assert_same_run(got, ref)


@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_pipeline_context_tensor_with_dropout(small_config, impl):
    """Pipeline 2 x context 2 x tensor 2 (+ sequence parallelism), GPT with hidden dropout: the
    ring's k/v hops are collective-permutes that every device of every stage joins at every tick,
    and each device takes its part of the masks one device draws (in its tokens' natural order,
    which context parallelism reorders)."""
    gpt = ["model.family=gpt", "model.hidden_dropout=0.1"]
    ref = reference(small_config, *REFERENCE, *gpt)
    got = run(small_config, *MODEL, *gpt, "mesh.pipeline=2", "mesh.data=1", "mesh.context=2", "mesh.tensor=2",
              "train.micro_batch=2", "parallel.sequence_parallel=true", f"parallel.context_impl={impl}",
              devices=jax.devices())
    assert_same_run(got, ref)


@pytest.mark.parametrize("overrides", [
    ["mesh.tensor=2", "parallel.sequence_parallel=true"],
    ["mesh.context=2", "parallel.context_impl=ring"],
], ids=["expert2_tensor2_sp", "expert2_context2_ring"])
def test_pipeline_mixture_of_experts_with_tensor_or_context(small_config, overrides):
    """MoE through 1F1B stages with expert 2 and tensor 2 (+ SP: the router statistics of each
    rank's part of the sequence are summed over `tensor`) or context 2: Mixtral/DeepSeek-class
    PP x EP x TP. One device with the same 2 microbatches of 4 is the reference."""
    ref = moe_accumulation_reference(small_config)
    got = run(small_config, *MODEL, *MOE, "mesh.pipeline=2", "mesh.data=1", "mesh.expert=2", *overrides,
              "train.micro_batch=2", devices=jax.devices(), steps=3)
    assert_same_run(got, ref)


def test_dropout_without_pipeline_matches_one_device(small_config):
    """Data 2 x context 2 x tensor 2 (+ SP) with dropout: the masks one device draws, in the order
    context parallelism lays the tokens out; gradient accumulation runs on the whole batch."""
    gpt = ["model.family=gpt", "model.hidden_dropout=0.1"]
    ref = reference(small_config, *MODEL, "train.micro_batch=4", *gpt)  # the same 2 microbatches of 4
    got = run(small_config, *gpt, *MODEL, "mesh.data=2", "mesh.context=2", "mesh.tensor=2", "train.micro_batch=2",
              "parallel.sequence_parallel=true", devices=jax.devices())
    assert_same_run(got, ref)


# ----------------------------------------------------------------------------------------------
# cuDNN attention: inside context parallelism and the stages (lowered for CUDA: no GPU here)

def test_a_kernel_that_does_not_differentiate_its_log_sum_exp_is_made_exact():
    """cuDNN returns the log-sum-exp that context parallelism merges but does not differentiate it;
    `lse_differentiable` adds that part of the gradient. A kernel with the same defect (plain
    attention whose lse is cut from the graph) gets exactly the gradients of plain attention."""
    import jax.numpy as jnp
    import numpy as np
    from megajax.models.attention import lse_differentiable, xla_attention_with_lse

    ks = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(ks[0], (2, 16, 4, 8)), jax.random.normal(ks[1], (2, 16, 2, 8)),
               jax.random.normal(ks[2], (2, 16, 2, 8)))
    w_out, w_lse = jax.random.normal(ks[3], (2, 16, 4, 8)), jax.random.normal(ks[4], (2, 4, 16))
    for causal in (True, False):
        def defective(q, k, v):
            out, lse = xla_attention_with_lse(q, k, v, causal=causal)
            return out, jax.lax.stop_gradient(lse)

        def objective(attend):
            return lambda q, k, v: jnp.sum(attend(q, k, v)[0] * w_out) + jnp.sum(attend(q, k, v)[1] * w_lse)

        want = jax.grad(objective(lambda q, k, v: xla_attention_with_lse(q, k, v, causal=causal)), (0, 1, 2))(q, k, v)
        broken = jax.grad(objective(defective), (0, 1, 2))(q, k, v)
        fixed = jax.grad(objective(lse_differentiable(defective, 1 / np.sqrt(8))), (0, 1, 2))(q, k, v)
        for f, b, w in zip(fixed, broken, want):
            np.testing.assert_allclose(f, w, rtol=1e-5, atol=1e-6)
        assert max(float(jnp.max(jnp.abs(b - w))) for b, w in zip(broken[:2], want[:2])) > 0.1  # it was needed


def test_cudnn_attention_lowers_inside_pipeline_context_and_tensor_parallelism(small_config, monkeypatch):
    """The cuDNN path inside the stages is the one flash takes (the kernel per shard, and the per-block
    kernel with its log-sum-exp under context parallelism): the train step of pipeline 2 x context 2
    (ring) x tensor 2 + SP with model.attention_impl=cudnn lowers for CUDA, cuDNN's fused attention
    custom calls in it. cuDNN's version check (it needs a GPU) and the run's own device check are
    answered: nothing runs."""
    import numpy as np
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    from jax.sharding import NamedSharding, PartitionSpec as P
    import megajax.train.setup as setup_module
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(setup_module, "check_kernel_platform", lambda impl, platform: None)
    cfg = small_config(*MODEL, "mesh.pipeline=2", "mesh.data=1", "mesh.context=2", "mesh.tensor=2",
                       "train.micro_batch=2", "parallel.sequence_parallel=true", "model.attention_impl=cudnn",
                       "train.precision=bf16")
    setup = build_setup(make_plan(cfg, 8))
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=NamedSharding(setup.mesh, P()))
    text = setup.train_step().trace(setup.target(), batch, ok).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__cudnn$fmha") >= 8  # the ring's blocks, forward and backward, in the stage loop


def test_large_recipes_lower_their_train_step_for_their_mesh():
    """Llama 3 70B on 32 H100s (TP 8 x PP 4 interleaved + SP, cuDNN; bf16 and FP8) and Mixtral 8x7B
    (PP 4 x EP 4 x TP 2 + SP): each recipe is planned for its 32 devices and its train step lowered
    for CUDA from abstract arguments, on 32 simulated CPU devices (nothing allocated or run)."""
    import json
    import os
    import subprocess
    import sys

    recipes = ["configs/recipes/llama3-70b-32xh100.yaml", "configs/recipes/llama3-70b-32xh100-fp8.yaml",
               "configs/recipes/mixtral-8x7b-32xh100.yaml"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    worker = os.path.join(repo, "tests", "recipe_lowering_worker.py")
    out = subprocess.run([sys.executable, worker, "32", *recipes], cwd=repo, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": repo})
    assert out.returncode == 0, out.stderr[-3000:]
    got = {r["recipe"]: r for r in map(json.loads, out.stdout.splitlines())}
    llama, fp8, mixtral = (got[r] for r in recipes)
    for r in (llama, fp8):
        assert {a: n for a, n in r["mesh"].items() if n > 1} == {"pipeline": 4, "tensor": 8}
        assert r["pipeline"]["schedule"] == "interleaved" and r["pipeline"]["virtual_stages"] == 5
        assert r["cudnn_calls"] >= 2 and r["shard_map"] >= 1
    assert fp8["precision"] == "fp8" and fp8["fp8_operands"] > llama["fp8_operands"] == 0
    assert {a: n for a, n in mixtral["mesh"].items() if n > 1} == {"pipeline": 4, "expert": 4, "tensor": 2}
    assert mixtral["pipeline"]["schedule"] == "1f1b" and mixtral["cudnn_calls"] >= 2
