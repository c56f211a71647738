"""fp16 dynamic loss scaling and non-finite handling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layout_parity import BF16_GRAD_NORM_RTOL, BF16_LOSS_RTOL, assert_same_run, reference, run
from megajax.errors import TrainingError
from megajax.precision.loss_scale import DynamicLossScale
from megajax.train.loop import build_trainer, train
from megajax.train.optimizer import update_count


def test_loss_scale_rules():
    ls = DynamicLossScale(initial_scale=1024.0, window=3, hysteresis=2)
    s = ls.init()
    s = ls.update(s, jnp.bool_(True))  # first overflow spends hysteresis only
    assert float(s.scale) == 1024.0 and int(s.hysteresis_tracker) == 1
    s = ls.update(s, jnp.bool_(True))  # second one backs off
    assert float(s.scale) == 512.0
    for _ in range(3):
        s = ls.update(s, jnp.bool_(False))
    assert float(s.scale) == 1024.0 and int(s.hysteresis_tracker) == 2 and int(s.growth_tracker) == 0


def test_injected_overflow_skips_exactly_that_step_and_halves_the_scale(small_config):
    cfg = small_config("mesh.data=2", "mesh.tensor=4", "train.precision=fp16", "train.hysteresis=1",
                       "train.initial_loss_scale=1024", "optim.warmup_steps=0")
    tr = build_trainer(cfg)
    state, ok = tr.state, tr.setup.ok_flag()
    scales, updates, params = [], [], []
    for step in range(4):
        batch = tr.loader.batch(step * cfg.train.global_batch)
        if step == 2:  # inject an overflow: one infinite loss weight makes every gradient non-finite
            mask = np.asarray(batch["loss_mask"]).copy()
            mask[0, 0, 0] = np.inf
            batch["loss_mask"] = jax.device_put(mask, batch["loss_mask"].sharding)
        before = jax.device_get(state.params)
        state, m, ok = tr.step_fn(state, batch, ok)
        m = jax.device_get(m)
        scales.append(float(state.loss_scale.scale))
        updates.append(int(update_count(state.opt_state)))
        params.append(not all(np.array_equal(a, b) for a, b in
                              zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params)))))
        assert bool(m["skipped"]) == (step == 2)
    assert params == [True, True, False, True]  # only the injected step leaves parameters alone
    assert updates == [1, 2, 2, 3]
    assert scales == [1024.0, 1024.0, 512.0, 512.0]  # halved by the overflow, kept after


def test_fp16_from_megatron_default_scale_backs_off_and_trains(small_config):
    """From 2^32, overflows are skipped and the scale halves every `hysteresis` overflows until it fits."""
    res = train(small_config("train.precision=fp16", "mesh.data=8", "train.log_every=1", steps=40,))
    scales = [r["loss_scale"] for r in res.records]
    skipped = [r["skipped_steps"] for r in res.records]
    assert skipped[-1] > 0 and skipped[-1] == skipped[-5]  # overflowed at first, then clean
    assert scales[-1] < 2.0 ** 32 and scales == sorted(scales, reverse=True)
    assert res.losses[-1] < res.losses[0] - 0.5


def test_bf16_trains(small_config):
    """bf16 on tensor 4 x data 2 with sequence parallelism trains as fp32 does: per-step loss and grad
    norm within one bf16 rounding (layout_parity.BF16_*: u / 16 for the loss, a mean over 256 tokens'
    independent roundings, u for the grad norm) of the fp32 one-device run, the parity tests' reference."""
    ref = reference(small_config, params=False)  # fp32, one device
    got = run(small_config, "train.precision=bf16", "mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true",
              devices=jax.devices(), params=False)
    assert np.all(np.isfinite(got.losses)) and got.losses[-1] < got.losses[0]
    assert_same_run(got, ref, rtol=BF16_LOSS_RTOL, grad_norm_rtol=BF16_GRAD_NORM_RTOL, params=False)  # fp32's decreases


def test_nonfinite_loss_stops_naming_the_step_or_skips(small_config):
    cfg = small_config("optim.lr=1e30", "optim.clip_grad=0", "optim.warmup_steps=0", steps=4)
    with pytest.raises(TrainingError, match=r"non-finite loss or gradients at step \d"):
        train(cfg)
    res = train(small_config("optim.lr=1e30", "optim.clip_grad=0", "optim.warmup_steps=0",
                             "train.skip_nonfinite=true", steps=4))
    assert res.records[-1]["skipped_steps"] >= 1
