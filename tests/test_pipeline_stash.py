"""What a pipeline stage keeps for its backward (megajax/parallel/stash.py): the VJP residuals of each
in-flight microbatch's chunk, activations only (the weights, and what the forward makes of them
alone, are computed again from the weights), as many as `parallel.recompute` says; and what that
saves: a pipelined step's matrix FLOPs equal the unpipelined step's (no recomputed forward), its
compiled temporaries follow the analytic stash."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import megajax.parallel.pipeline as pipeline
from megajax.config import load_config
from megajax.parallel.stash import split_vjp
from megajax.perf import analytic
from megajax.perf.bench import matmul_table
from megajax.perf.fit import compiled_bytes
from megajax.plan import make_plan
from megajax.train.setup import build_setup

SMALL = ["model.num_layers=4", "model.hidden_size=128", "model.num_heads=4", "model.ffn_hidden_size=256",
         "train.seq_len=128", "train.micro_batch=1"]


def _step(overrides, devices: int):
    """(setup, the train step traced on abstract inputs) of a small Llama on `devices` devices."""
    cfg = load_config(overrides=[*SMALL, *overrides])
    setup = build_setup(make_plan(cfg, devices), jax.devices()[:devices])
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
    return setup, setup.train_step().trace(setup.target(), batch, ok)


def _stash_split(monkeypatch, *overrides, devices: int = 2):
    """(plan, the split of a chunk's VJP residuals the stage loop traced) on pipeline 2."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(split_vjp(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(pipeline, "split_vjp", spy)
    setup, _ = _step(["mesh.pipeline=2", "mesh.data=1", "train.global_batch=4", *overrides], devices)
    assert len(seen) == 1
    return setup.plan, seen[0]


def test_split_vjp_recomputes_what_the_weights_alone_give():
    """A scanned stack whose layers cast and concatenate their weights: the bf16 copy of the weights is
    computed again from them, the stash keeps the activations only, and the VJP put back together
    equals jax.vjp's."""
    def stack(w, x):
        def layer(h, wl):
            wq = jnp.concatenate([wl, wl], axis=1).astype(jnp.bfloat16)
            return jnp.tanh(h.astype(jnp.bfloat16) @ wq).astype(jnp.float32)[:, :h.shape[1]], None
        return jax.lax.scan(layer, x, w)[0]

    w = jax.random.normal(jax.random.key(0), (3, 64, 64))
    x = jax.random.normal(jax.random.key(1), (4, 64))
    split = split_vjp(lambda k, u: (*jax.vjp(stack, k[0], u[0]), {}), (w,), (x,))
    assert all(a.shape[1] == 4 for a in split.kept_avals)  # [layers, rows, ...]: activations
    assert split.kept_bytes() == 3 * 4 * (64 + 128 + 128) * 2 < 3 * 64 * 128 * 2  # the weights' bf16 copy: again

    @jax.jit
    def through(w, x, g):
        y, _, kept = split.forward((w,), (x,))
        return y, split.backward((w,), kept)(g)

    g = jax.random.normal(jax.random.key(2), (4, 64))
    y, grads = through(w, x, g)
    y0, vjp0 = jax.vjp(stack, w, x)
    np.testing.assert_array_equal(y, y0)
    for a, b in zip(grads, vjp0(g)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_stash_holds_activations_not_weights(monkeypatch, precision):
    """A chunk's kept residuals are per-microbatch activations: twice the micro batch keeps exactly
    twice the bytes (no weight-sized term, also in bf16 where the layers cast their fp32 weights and
    the fused q/k/v kernel is a concatenation of three), none has a weight's shape, and per slot they
    are within [0.75, 1.5] of the analytic layer activations (Korthikanti's count, which bench and
    the planner use) of the chunk's layers."""
    plan, split = _stash_split(monkeypatch, f"train.precision={precision}")
    _, twice = _stash_split(monkeypatch, f"train.precision={precision}", "train.micro_batch=2", "train.global_batch=8")
    assert twice.kept_bytes() == 2 * split.kept_bytes()
    weights = {tuple(x.shape[1:]) for x in jax.tree.leaves(build_setup(plan, jax.devices()[:2]).spec.abstract_params)}
    assert not any(tuple(a.shape[1:]) in weights for a in split.kept_avals)
    per_chunk = analytic.layer_activation_bytes(plan) * plan.cfg.model.num_layers / 2
    assert 0.75 <= split.kept_bytes() / per_chunk <= 1.5, (split.kept_bytes(), per_chunk)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_full_recompute_stashes_each_layers_input(monkeypatch, precision):
    """parallel.recompute=full keeps what Megatron's full recompute keeps of an in-flight microbatch:
    each layer's input, and nothing else (the analytic count exactly)."""
    plan, split = _stash_split(monkeypatch, f"train.precision={precision}", "parallel.recompute=full")
    per_chunk = analytic.layer_activation_bytes(plan) * plan.cfg.model.num_layers / 2
    assert split.kept_bytes() == per_chunk
    assert len(split.kept_avals) == 1 and split.kept_avals[0].shape == (2, 1, 128, 128)


def _matmul_flops(*overrides) -> float:
    setup, traced = _step(["train.global_batch=16", *overrides], 8)
    table = matmul_table(setup.plan, traced.lower().compile(), setup.flops_per_step / 8)
    return table["own_flops"]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_pipelined_matmul_flops_equal_the_unpipelined_steps(recompute):
    """With the residuals kept, a stage recomputes nothing of its own: a pipelined step's matrix FLOPs
    (read from the compiled HLO, each branch of the stage loop counted as often as the schedule runs
    it) are the unpipelined step's within 2 % at P = 2 and 4, with and without full recompute (when
    the backward half recomputed its chunk, 4/3 of it without recompute)."""
    flat = _matmul_flops("mesh.data=8", f"parallel.recompute={recompute}")
    for stages in (2, 4):
        piped = _matmul_flops(f"mesh.pipeline={stages}", f"mesh.data={8 // stages}", f"parallel.recompute={recompute}")
        assert abs(piped / flat - 1) <= 0.02, (stages, piped / flat)


def test_compiled_temporaries_follow_the_analytic_stash():
    """Each stash slot costs the compiled step what the analytic stash says (bench's and the planner's
    figure): GPipe's temporaries grow with its microbatches by the analytic stash's growth within 10 %
    (one microbatch's chunk residuals per slot, and its output waiting for the loss on the last
    stage); 1F1B's hold the stash of 2 P - 1 slots at P = 2 and 4."""
    def measured(*overrides):
        setup, traced = _step(list(overrides), 8)
        return analytic.pipeline_stash_bytes(setup.plan), compiled_bytes(traced.lower().compile())["temporaries"]

    gpipe = ["mesh.pipeline=2", "mesh.data=4", "parallel.pipeline_schedule=gpipe"]
    stash2, temps2 = measured(*gpipe, "train.global_batch=8")
    stash4, temps4 = measured(*gpipe, "train.global_batch=16")
    assert 0.9 <= (temps4 - temps2) / (stash4 - stash2) <= 1.1, (temps4 - temps2, stash4 - stash2)
    for stages in (2, 4):
        stash, temporaries = measured(f"mesh.pipeline={stages}", f"mesh.data={8 // stages}", "train.global_batch=16")
        assert stash <= temporaries, (stages, stash, temporaries)
