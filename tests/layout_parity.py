"""Runs a layout and compares it with one device: per-step loss and grad norm, and the parameters
after step 1 (fp32, rel 1e-5).

Losses alone miss gradient-scale bugs: AdamW is nearly invariant to a constant scale of one
tensor's gradient and clipping hides a uniform one, so a gradient summed instead of averaged over
a mesh axis trains the same. The grad norm sees the scale; the parameters after the first update
see every tensor's gradient direction.

Runs use warmup 0, so step 1 updates the parameters; they are read back from the checkpoint the
run writes after step 1. Context-parallel runs are kept out of JAX's persistent compilation cache:
on CPU a context-parallel step (layers scanned) loaded from that cache deadlocks in its
collectives, and a layout may run twice in a session (the property test's examples, its replay of
a failure).
Adam's eps is 1e-3 rather than 1e-8: Adam's first update is lr * g / (|g| + eps), whose slope
lr / eps turns the rounding difference of a near-zero gradient element (the reduction order differs
between layouts; ~1e-8 for a bias summed over all tokens) into a parameter difference: up to 3e-3
with eps 1e-8 (the update becomes sign(g)), ~3e-8 with eps 1e-3, under the tolerance. Gradient
elements below eps then move the parameters in proportion, so the parameters see gradient scale
as well as direction.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest

from megajax.checkpoint.manager import CheckpointSource
from megajax.train.loop import train

STEPS = 4
PARITY = ["optim.warmup_steps=0", f"optim.decay_steps={STEPS}", "optim.eps=1e-3"]
RTOL = 1e-5
# bf16 (activations and products in bf16, fp32 master weights, gradients and reductions). A layout
# changes where partial results are rounded to bf16 (per shard before a reduction, or once after
# it), so a value may differ by one bf16 rounding, u = 2^-8 = 3.9e-3 relative. The loss is a mean
# over 256 tokens whose rounding errors are independent: ~u / sqrt(256) = u / 16. The grad norm
# gathers one rounding per gradient element; aligned in the worst case, that is u. Measured on the
# bf16 layouts of tests/test_parity.py: loss within 4e-5, grad norm within 9e-4 of one device's bf16
# run; bf16 itself moves them from fp32 by up to 9e-5 / 5e-4 (tensor 4 x data 2 with sequence
# parallelism, tests/test_precision.py: 2e-5 / 5e-4).
BF16_LOSS_RTOL = 2.0 ** -8 / 16
BF16_GRAD_NORM_RTOL = 2.0 ** -8


def family(name: str) -> list[str]:
    """The override for a model family (llama is the default: no override, so references are shared)."""
    return [] if name == "llama" else [f"model.family={name}"]


@dataclass
class Run:
    losses: np.ndarray  # [steps]
    grad_norms: np.ndarray  # [steps], before clipping
    params1: dict | None  # parameters after step 1 by name ("layers/attn/q/kernel"); None: not saved
    moe: dict | None = None  # a MoE model's logged metrics per step ("moe_aux_loss": [steps], ...)
    expert_bias: np.ndarray | None = None  # the MoE routers' expert bias after the last step, if any
    mixture_of_experts: bool = False  # from the run's config (model.num_experts > 0), not from its records
    mtp_losses: np.ndarray | None = None  # multi-token prediction's loss per step (model.mtp_num_layers), if any

    def first(self, steps: int) -> "Run":
        """The first `steps` steps of this run (the parameters after step 1 kept; the expert bias, the
        last step's, dropped)."""
        moe = None if self.moe is None else {k: v[:steps] for k, v in self.moe.items()}
        mtp = None if self.mtp_losses is None else self.mtp_losses[:steps]
        return Run(self.losses[:steps], self.grad_norms[:steps], self.params1, moe, None, self.mixture_of_experts, mtp)


@contextlib.contextmanager
def not_persistently_cached():
    """Compilations in this context are not written to JAX's persistent compilation cache."""
    key = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, key)
    jax.config.update(key, 1e9)
    try:
        yield
    finally:
        jax.config.update(key, before)


def run(small_config, *overrides, devices=None, steps: int = STEPS, params: bool = True) -> Run:
    saves = ["checkpoint.every=1", f"checkpoint.keep={steps}"] if params else []
    context = any(o.startswith("mesh.context=") and o != "mesh.context=1" for o in overrides)
    cfg = small_config(*PARITY, *overrides, *saves, steps=steps)
    with not_persistently_cached() if context else contextlib.nullcontext():
        result = train(cfg, devices=devices)
    grad_norms = np.asarray([r["grad_norm"] for r in result.records])
    assert len(result.losses) == len(grad_norms) == steps
    params1 = None
    if params:
        saved = CheckpointSource(Path(result.run_dir) / "checkpoints" / "1")
        params1 = {name: saved.get(name) for name in saved.names()}  # with the expert bias after step 1
    moe = {k: np.asarray([r[k] for r in result.records]) for k in result.records[0] if k.startswith("moe_")}
    bias = result.state.moe_expert_bias
    mtp = np.asarray([r["mtp_loss"] for r in result.records]) if cfg.model.mtp_num_layers else None
    return Run(np.asarray(result.losses), grad_norms, params1, moe or None, None if bias is None else np.asarray(bias),
               mixture_of_experts=cfg.model.num_experts > 0, mtp_losses=mtp)


_references: dict = {}

# A small mixture of experts (8 experts, top 2, both router losses on) for the MoE parity tests.
MOE = ["model.num_experts=8", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64",
       "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"]


def reference(small_config, *overrides, steps: int = STEPS, params: bool = True) -> Run:
    """One device (cached per overrides within the test session)."""
    key = (overrides, steps)
    cached = _references.get(key)
    if cached is None or (params and cached.params1 is None):
        _references[key] = run(small_config, "mesh.data=1", *overrides, devices=jax.devices()[:1], steps=steps,
                               params=params)
    return _references[key]


def moe_accumulation_reference(small_config, *model: str) -> Run:
    """One device, 4 layers, MoE with `model`'s extra options, 2 microbatches of 4 sequences per step, 3 steps:
    the reference of the MoE runs through pipeline stages (tests/test_pipeline.py) and of the expert-parallel
    runs with 2 microbatches per step (tests/test_moe_parity.py), computed once for both."""
    return reference(small_config, "model.num_layers=4", *MOE, *model, "train.micro_batch=4", steps=3)


def assert_same_run(got: Run, ref: Run, rtol: float = RTOL, grad_norm_rtol: float | None = None,
                    params_atol: float = 1e-7, *, params: bool = True, moe: bool | None = None) -> None:
    """Per-step loss and grad norm; what else is compared is asked for, and a run that lacks it fails:

    params: the parameters after step 1; both runs must have saved them (run(..., params=True)). Pass
      params=False where a run does not save them.
    moe: the MoE metrics per step; both runs must have logged them. None: when the reference is a mixture
      of experts (by its config). Half-precision runs pass moe=False: a rounding may route a token to
      another expert, moving the expert shares by whole tokens.
    The expert bias after the last step, and multi-token prediction's loss per step, are compared whenever
    either run has them (then both must)."""
    assert ref.losses[-1] < ref.losses[0]  # it trains
    np.testing.assert_allclose(got.losses, ref.losses, rtol=rtol, atol=0, err_msg="loss per step")
    np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=grad_norm_rtol or rtol, atol=0,
                               err_msg="grad norm per step")
    if got.mixture_of_experts != ref.mixture_of_experts:
        pytest.fail(f"comparing a {'MoE' if got.mixture_of_experts else 'dense'} run with a "
                    f"{'MoE' if ref.mixture_of_experts else 'dense'} reference")
    if params:
        _require("params1", "parameters after step 1 (run it with params=True, or pass params=False to "
                 "assert_same_run)", got, ref)
        assert_same_params(got.params1, ref.params1, rtol, params_atol)
    if moe is None:
        moe = ref.mixture_of_experts
    if moe:
        _require("moe", "MoE metrics (moe_* in its records)", got, ref)
        assert sorted(got.moe) == sorted(ref.moe)
        for key, want in ref.moe.items():
            np.testing.assert_allclose(got.moe[key], want, rtol=1e-4, atol=1e-7, err_msg=f"{key} per step")
    if got.mtp_losses is not None or ref.mtp_losses is not None:
        _require("mtp_losses", "multi-token prediction loss (the other run has one)", got, ref)
        np.testing.assert_allclose(got.mtp_losses, ref.mtp_losses, rtol=rtol, atol=0, err_msg="mtp_loss per step")
    if got.expert_bias is not None or ref.expert_bias is not None:
        # moved by +-rate per step from the token counts: equal counts, equal bias
        _require("expert_bias", "expert bias (the other run has one)", got, ref)
        np.testing.assert_allclose(got.expert_bias, ref.expert_bias, rtol=0, atol=1e-7,
                                   err_msg="expert bias after the last step")


def _require(field: str, what: str, got: Run, ref: Run) -> None:
    for side, r in (("run", got), ("reference", ref)):
        if getattr(r, field) is None:
            pytest.fail(f"assert_same_run: the {side} has no {what}")


def assert_same_params(got: dict, want: dict, rtol: float = RTOL, atol: float = 1e-7) -> None:
    assert sorted(got) == sorted(want) and len(want) > 5
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol, err_msg=f"parameter {name} after step 1")
