"""The optimizer against Megatron: learning-rate schedule (Megatron-Core's own scheduler as the
judge), the weight-decay mask, and global-norm clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megajax.config import OptimConfig, load_config
from megajax.train.optimizer import clip_coefficient, decay_mask, lr_schedule, make_optimizer, update_count
from megajax.train.state import build_model_spec


class _Groups:
    """The one thing Megatron's scheduler needs of an optimizer: parameter groups to write lr into."""
    def __init__(self):
        self.param_groups = [{}]


def megatron_lrs(cfg: OptimConfig, decay_steps: int, counts) -> list[float]:
    sched = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    s = sched.OptimizerParamScheduler(
        _Groups(), init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=cfg.decay_style, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
    out = []
    for n in counts:
        s.num_steps = n  # updates applied so far (Megatron steps the scheduler after each update)
        out.append(s.get_lr({}))
    return out


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup, decay_steps, min_lr", [(10, 100, 3e-5), (0, 50, 0.0), (1, 7, 1e-4)])
def test_lr_schedule_matches_megatron_core(style, warmup, decay_steps, min_lr):
    cfg = OptimConfig(lr=3e-4, min_lr=min_lr, warmup_steps=warmup, decay_style=style, decay_steps=decay_steps)
    counts = sorted({0, 1, max(warmup - 1, 0), warmup, warmup + 1, (warmup + decay_steps) // 2,
                     decay_steps - 1, decay_steps, decay_steps + 1, 3 * decay_steps})
    ours = jax.jit(jax.vmap(lr_schedule(cfg, total_steps=10**6)))(jnp.asarray(counts, jnp.int32))
    # fp32 against Megatron's float64: equal up to rounding relative to the peak lr (XLA divides by a
    # constant as a multiply by its reciprocal, so the end of a linear decay to 0 is 7e-12, not 0).
    np.testing.assert_allclose(np.asarray(ours), megatron_lrs(cfg, decay_steps, counts), rtol=2e-6,
                               atol=1e-7 * cfg.lr)


def test_lr_schedule_decays_over_train_steps_by_default():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_style="cosine", decay_steps=None)
    f = lr_schedule(cfg, total_steps=20)
    np.testing.assert_allclose([float(f(c)) for c in (0, 1, 2, 11, 20, 25)],
                               megatron_lrs(cfg, 20, (0, 1, 2, 11, 20, 25)), rtol=2e-6)


def test_lr_schedule_with_decay_shorter_than_warmup():
    """Megatron refuses decay_steps <= warmup_steps; megajax warms up, then holds min_lr."""
    f = lr_schedule(OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=20, decay_steps=10), total_steps=10)
    np.testing.assert_allclose([float(f(c)) for c in (0, 10, 20, 21, 100)], [0, 5e-4, 1e-3, 1e-4, 1e-4], rtol=1e-6)


def _model_params(family):
    cfg = load_config(overrides=[f"model.family={family}", "model.num_layers=2", "model.hidden_size=32",
                                 "model.num_heads=4", "model.ffn_hidden_size=64", "model.vocab_size=100"])
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    return jax.jit(init)()


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_weight_decay_skips_biases_and_norms_exactly(family):
    params = _model_params(family)
    mask = decay_mask(params)
    names = {"/".join(getattr(k, "key", str(k)) for k in path): m
             for path, m in jax.tree_util.tree_flatten_with_path(mask)[0]}
    assert names["embed/embedding"] and names["layers/attn/q/kernel"] and names["layers/mlp/fc2/kernel"]
    for name, decayed in names.items():
        assert decayed == (not (name.endswith("bias") or "norm" in name)), name
    if family == "gpt":
        assert not names["layers/attn/q/bias"] and not names["final_norm/bias"]
    # One update with zero gradients: Adam's part is 0, so p -> p - lr * wd * p where decayed, else p.
    cfg = OptimConfig(lr=0.5, min_lr=0.5, warmup_steps=0, decay_style="constant", weight_decay=0.1)
    tx = make_optimizer(cfg, total_steps=10)

    @jax.jit
    def one_update(params):
        updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
        return optax.apply_updates(params, updates), state

    new, state = one_update(params)
    assert int(update_count(state)) == 1
    for (path, p), n, m in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(new),
                               jax.tree.leaves(mask)):
        np.testing.assert_allclose(n, p * (1 - 0.5 * 0.1) if m else p, rtol=1e-6, err_msg=str(path))


def test_adamw_update_matches_the_formula():
    """p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), two steps, by hand."""
    cfg = OptimConfig(lr=0.1, min_lr=0.1, warmup_steps=0, decay_style="constant", weight_decay=0.01,
                      beta1=0.9, beta2=0.95, eps=1e-8)
    tx = make_optimizer(cfg, total_steps=10)
    p = {"w": jnp.asarray([1.0, -2.0, 3.0])}
    grads = [np.array([0.5, -1.0, 2.0]), np.array([-0.25, 0.5, 1.0])]
    state, want, m, v = tx.init(p), np.array([1.0, -2.0, 3.0]), 0.0, 0.0
    for t, g in enumerate(grads, 1):
        upd, state = tx.update({"w": jnp.asarray(g)}, state, p)
        p = optax.apply_updates(p, upd)
        m, v = 0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g * g
        want = want - 0.1 * ((m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.95 ** t)) + 1e-8) + 0.01 * want)
    np.testing.assert_allclose(p["w"], want, rtol=1e-6)


@pytest.mark.parametrize("frozen", [None, lambda path: path.startswith("frozen")])
def test_a_given_learning_rate_is_the_schedule_s_value_and_is_not_recomputed_per_parameter(frozen):
    """update(..., learning_rate=lr) with lr the schedule's value at the update's count (what the train
    step passes): the same updates and state, bit for bit, over warmup and decay; and the compiled
    update evaluates no schedule (without it, XLA copies the cosine into each parameter's loop)."""
    cfg = OptimConfig(lr=0.1, min_lr=0.01, warmup_steps=2, decay_steps=6, decay_style="cosine",
                      weight_decay=0.1)
    tx, schedule = make_optimizer(cfg, 6, frozen), lr_schedule(cfg, 6)
    rng = np.random.default_rng(0)
    params = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
              for name, shape in [("w", (4, 3)), ("b/bias", (3,)), ("norm/scale", (3,)), ("frozen", (2,))]}
    given = jax.jit(lambda g, s, p: tx.update(g, s, p, learning_rate=schedule(update_count(s))))
    own = jax.jit(tx.update)
    s_given = s_own = tx.init(params)
    for _ in range(5):
        grads = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in params.items()}
        (u_given, s_given), (u_own, s_own) = given(grads, s_given, params), own(grads, s_own, params)
        for a, b in zip(jax.tree.leaves((u_given, s_given)), jax.tree.leaves((u_own, s_own))):
            np.testing.assert_array_equal(a, b)
        params = optax.apply_updates(params, u_own)
    text = lambda f, *a: jax.jit(f).lower(*a).compile().as_text()
    assert "cosine(" not in text(lambda g, s, p, lr: tx.update(g, s, p, learning_rate=lr), grads, s_own, params,
                                 jnp.float32(0.1))
    assert text(tx.update, grads, s_own, params).count("cosine(") >= 1


def megatron_clip(grads: list[np.ndarray], max_norm: float) -> tuple[list[np.ndarray], float]:
    """Megatron-Core's get_grad_norm_fp32 + clip_grad_by_total_norm_fp32, in numpy."""
    total = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads)))
    coeff = max_norm / (total + 1.0e-6)
    return ([g * coeff for g in grads] if coeff < 1.0 else grads), total


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 100.0])
def test_clipping_matches_megatron_and_reports_the_pre_clip_norm(max_norm):
    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(7, 5)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    def clip(g, max_norm):  # as the train step: the pre-clip norm, the factor applied to every leaf
        norm = optax.tree.norm(g)
        coeff = clip_coefficient(norm, max_norm)
        return jax.tree.map(lambda x: x * coeff, g), norm

    got, norm = jax.jit(lambda g: clip(g, max_norm))(grads)
    want, total = megatron_clip([grads["a"], grads["b"]], max_norm)
    np.testing.assert_allclose(float(norm), total, rtol=1e-6)
    for g, w in zip((got["a"], got["b"]), want):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    if max_norm < total:  # clipped onto the ball (up to Megatron's 1e-6)
        np.testing.assert_allclose(float(optax.tree.norm(got)), max_norm, rtol=1e-5)
    off, norm_off = clip(grads, 0.0)
    assert float(clip_coefficient(norm_off, 0.0)) == 1.0 and float(norm_off) == pytest.approx(total, rel=1e-6)
    for g, w in zip((off["a"], off["b"]), (grads["a"], grads["b"])):
        np.testing.assert_array_equal(g, w)


def test_train_step_clips_and_logs_the_pre_clip_norm(small_config):
    """One device: with clipping tighter than the gradient norm, the logged step-1 grad norm is the
    unclipped one (the parameters at step 1 do not depend on clipping), and clipping changes the
    trajectory. (Adam's first update is nearly scale-free; the later ones see the varying scale.)"""
    from layout_parity import reference, run
    ref = reference(small_config)  # clip_grad 1.0 (below its grad norms too)
    clipped = run(small_config, "mesh.data=1", "optim.clip_grad=0.05", devices=jax.devices()[:1], params=False)
    assert ref.grad_norms[0] > 1.0
    assert clipped.grad_norms[0] == pytest.approx(ref.grad_norms[0], rel=1e-6)
    assert abs(clipped.losses[3] - ref.losses[3]) > 1e-3
