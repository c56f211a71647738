"""The precision policy of a run: one frozen object built from train.precision (and precision.*).

    policy = precision_policy(cfg)

says which dtype each kind of tensor has and what runs in FP8:

    train.precision   params  master  compute  gradients  reduction  loss scaling  FP8 products
    fp32              fp32    -       fp32     fp32       fp32       none          none
    bf16              bf16    fp32    bf16     fp32       fp32       none          none
    fp16              fp16    fp32    fp16     fp32       fp32       dynamic       none
    fp8               bf16    fp32    bf16     fp32       fp32       none          the linear layers' (FP8_PRODUCTS
                                                                                   less precision.fp8_bf16_products;
                                                                                   + output layer if asked)

With precision.param_dtype `compute` (the default) the train state holds the parameters in the
compute dtype, as Megatron's 16-bit model does, and the optimizer an fp32 master copy of them
(Megatron's main params; megajax/train/optimizer.py), which it updates and casts back; with `fp32`
the parameters are fp32 and there is no copy (then cast to the compute dtype where they are used).
The forward pass sees the same values either way (the compute-dtype rounding of the fp32 values).
Gradients are fp32 (cast from the compute dtype as each microbatch's come out), and so is their
data-parallel reduction. With fp8 the linear layers' products take float8 operands and produce
bf16: the per-tensor recipes (`delayed`, `current`) take e4m3 inputs and weights and e5m2 output
gradients (Megatron's "hybrid" format), the block-scaled ones (`blockwise`, `mxfp8`) e4m3 for all
three (the fnuz types on ROCm); everything else (embedding, norms, attention core, softmax, loss)
stays bf16/fp32. Code asks the policy, never compares precision names.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from megajax.config import FP8_PRODUCT_NAMES, Config, PrecisionConfig

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# The linear products FP8 can replace (Transformer Engine's te.Linear / LayerNormLinear /
# LayerNormMLP / GroupedLinear), by name: megajax/config.py FP8_PRODUCT_NAMES.
FP8_PRODUCTS = FP8_PRODUCT_NAMES
FP8_RECIPES = ("delayed", "current", "blockwise", "mxfp8")
# Megatron's names of the recipes megajax names otherwise (--fp8-recipe tensorwise).
RECIPE_ALIASES = {"tensorwise": "current"}


@dataclasses.dataclass(frozen=True)
class Fp8Policy:
    """Which products run in FP8 and how they are scaled (precision.* keys)."""
    recipe: str                 # FP8_RECIPES ("tensorwise" given as "current")
    amax_history_len: int       # delayed: steps of amax history per tensor
    margin: int                 # scale = fp8_max / amax / 2^margin
    impl: str                   # model.matmul_impl: "xla" | "pallas"
    products: tuple[str, ...]   # FP8_PRODUCTS less the kept ones, + "output_layer" (precision.fp8_output_layer)
    param_gather: bool = False  # precision.fp8_param_gather

    @property
    def delayed(self) -> bool:
        return self.recipe == "delayed"

    @property
    def block_scaled(self) -> bool:
        """blockwise or mxfp8: every block scaled by its own amax, e4m3 throughout, no state."""
        return self.recipe in ("blockwise", "mxfp8")

    @property
    def output_layer(self) -> bool:
        return "output_layer" in self.products


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    name: str                   # train.precision
    param_dtype: np.dtype       # the train state's parameters (precision.param_dtype)
    master_dtype: np.dtype | None  # the optimizer's master copy of them (None: the parameters are it)
    compute_dtype: np.dtype     # activations and the products not in FP8
    grad_dtype: np.dtype        # gradients as accumulated over microbatches
    reduction_dtype: np.dtype   # data-parallel gradient reduction
    loss_scaling: str           # "none" | "dynamic" (fp16: Megatron's dynamic loss scale)
    fp8: Fp8Policy | None       # None: no FP8 products

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaling == "dynamic"

    @property
    def activation_bytes(self) -> int:
        """Bytes of one stored activation (the compute dtype; FP8 keeps bf16 activations: its
        products' float8 copies are extra, one byte per input value)."""
        return self.compute_dtype.itemsize

    @property
    def peak_flops_key(self) -> str:
        """Which datasheet peak a step's MFU is measured against (megajax/train/flops.py)."""
        return "fp8" if self.fp8 is not None else {"float32": "fp32", "bfloat16": "bf16",
                                                   "float16": "fp16"}[self.compute_dtype.name]

    @property
    def inference_dtype(self) -> np.dtype:
        """Generation runs in the compute dtype without FP8 products (no scaling state at inference)."""
        return self.compute_dtype


_COMPUTE = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16, "fp8": jnp.bfloat16}


def make_policy(precision: str, fp8: PrecisionConfig | None = None, matmul_impl: str = "xla",
                param_dtype: str = "compute") -> PrecisionPolicy:
    """The policy of `precision` (one of PRECISIONS); `fp8` and `matmul_impl` are read for fp8;
    `param_dtype`: precision.param_dtype."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: accepted {PRECISIONS}")
    f32 = np.dtype(jnp.float32)
    fp8_policy = None
    if precision == "fp8":
        p = fp8 or PrecisionConfig()
        kept = set(p.fp8_bf16_products)
        fp8_policy = Fp8Policy(recipe=RECIPE_ALIASES.get(p.fp8_recipe, p.fp8_recipe),
                               amax_history_len=p.fp8_amax_history_len, margin=p.fp8_margin, impl=matmul_impl,
                               products=tuple(n for n in FP8_PRODUCTS if n not in kept)
                               + (("output_layer",) if p.fp8_output_layer else ()),
                               param_gather=p.fp8_param_gather)
    compute = np.dtype(_COMPUTE[precision])
    params = compute if param_dtype == "compute" else f32
    return PrecisionPolicy(name=precision, param_dtype=params, master_dtype=None if params == f32 else f32,
                           compute_dtype=compute, grad_dtype=f32, reduction_dtype=f32,
                           loss_scaling="dynamic" if precision == "fp16" else "none", fp8=fp8_policy)


def precision_policy(cfg: Config) -> PrecisionPolicy:
    """The policy of a run's config (train.precision, precision.*, model.matmul_impl)."""
    return make_policy(cfg.train.precision, cfg.precision, cfg.model.matmul_impl, cfg.precision.param_dtype)
