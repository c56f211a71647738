"""Train state and its shardings.

TrainState holds everything a step changes: step counter, parameters (a
nested dict mirroring the model; fp32, or the compute dtype with an fp32 master
copy in the optimizer state: precision.param_dtype), optimizer state, the fp16 loss scale,
the FP8 scaling state, and the RNG key data. Shardings of every leaf come from
the rules tables.

The model's state is split by variable type: `nnx.Param` leaves are the
parameters (what the optimizer updates and weight-decays), `Fp8Meta` leaves the
FP8 scaling state (updated by the train step from the products' amaxes,
replicated on every device).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from optax import MaskedNode
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.config import Config, ModelConfig, moe_token_dispatcher
from megajax.mesh import (
    ShardingRules, fp8_param_gather, mesh_sizes, pad_to, padded_shape, tree_shardings, unpad_to)
from megajax.models import param_axes
from megajax.models.vision import build_model
from megajax.models.layout import has_expert_bias
from megajax.errors import ConfigError
from megajax.models.attention import BLOCK_ATTENTION, make_attention_core
from megajax.models.layers import LinearOps, flat_dot_general
from megajax.models.trainable import frozen_parameters, join, split_frozen
from megajax.models.transformer import shift_left
from megajax.parallel.context import (context_parallel_attention, mamba_context, sequence_shift, sharded_attention,
                                      sharded_ssd)
from megajax.parallel import experts
from megajax.parallel.tensor import tensor_parallel_ops
from megajax.precision.fp8 import Fp8Dot, Fp8Meta, initial_fp8_state
from megajax.precision.loss_scale import DynamicLossScale, LossScaleState
from megajax.precision.policy import precision_policy


@struct.dataclass
class TrainState:
    step: jax.Array  # i32 []
    params: dict
    opt_state: optax.OptState
    loss_scale: LossScaleState | None
    rng: jax.Array  # u32 [2] (raw key data)
    # FP8 scaling state (delayed recipe), a nested dict like the model's (Fp8Meta leaves); None
    # without one. Not a parameter: the optimizer never sees it.
    fp8: dict | None = None
    # The MoE routers' expert bias [layers, E] fp32 (model.moe_router_bias_update_rate > 0), None
    # without one: moved by the train step from each step's token counts, never by the optimizer.
    moe_expert_bias: jax.Array | None = None
    # With model.lora: the frozen base parameters (`params` then holds the adapters alone, which are
    # all that gradients, the optimizer and checkpoints see); None without adapters.
    frozen: dict | None = None


@dataclass
class ModelSpec:
    """Everything needed to run the model functionally: graphdef + parameter metadata."""
    graphdef: Any
    axes: dict  # logical axes per parameter (same tree as params)
    abstract_params: dict  # ShapeDtypeStructs
    abstract_fp8: dict | None = None  # ShapeDtypeStructs of the FP8 scaling state; None: none
    # Multi-token prediction's shift along the sequence for this layout (the model's, for its labels).
    sequence_shift: Callable = shift_left
    # model.lora: the frozen parameters' axes and shapes (`axes` and `abstract_params` are then the
    # trainable ones': the adapters, a vision-language model's projector ...); None without adapters.
    frozen_axes: dict | None = None
    abstract_frozen: dict | None = None
    frozen_path: Callable[[str], bool] | None = None  # with frozen_axes: which paths they are (trainable.py)

    def split(self, params: dict) -> tuple[dict, dict | None]:
        """(trainable, frozen) parts of a whole parameter tree: (params, None) without adapters."""
        return (params, None) if self.frozen_axes is None else split_frozen(params, self.frozen_path)

    def apply(self, params: dict, *args, fp8: dict | None = None, frozen: dict | None = None, **kwargs) -> jax.Array:
        """The model on `params` (and, with FP8 scaling state, `fp8`; a fresh state when None); with
        adapters, `frozen` holds the rest of the parameters, which get no gradient."""
        if frozen is not None:
            params = join(jax.lax.stop_gradient(frozen), params)
        if self.abstract_fp8 is None:
            return nnx.merge(self.graphdef, params)(*args, **kwargs)
        fp8 = self.init_fp8() if fp8 is None else fp8
        return nnx.merge(self.graphdef, params, fp8)(*args, **kwargs)

    def init_fp8(self) -> dict | None:
        """A fresh FP8 scaling state (scales 1, empty amax histories), or None."""
        return None if self.abstract_fp8 is None else initial_fp8_state(self.abstract_fp8)


def plain_dot(mesh: Mesh | None):
    """The plain product of this back end (XLA partitions it over the mesh)."""
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    return flat_dot_general() if platform == "cpu" else jax.lax.dot_general


def linear_ops(cfg: Config, mesh: Mesh | None, rules: ShardingRules | None) -> LinearOps:
    """The model's injected products for this layout, back end and precision (FP8: the linear
    layers get stateful FP8 products, see megajax/precision/fp8.py). Their collectives are written
    out (megajax/parallel/tensor.py) under sequence parallelism, and inside the pipeline stages,
    which run manual over every mesh axis; elsewhere XLA partitions the plain products. On a GPU
    with parallel.tp_comm_overlap the sequence-parallel products are collective matmuls."""
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    dot = flat_dot_general() if platform == "cpu" else jax.lax.dot_general
    fp8 = precision_policy(cfg).fp8
    gather = (fp8_param_gather(mesh, tuple(rules.params["embed"]))
              if fp8 is not None and fp8.param_gather and mesh is not None and rules is not None else None)
    low = {} if fp8 is None else dict(
        low_precision=lambda layout, side: Fp8Dot(fp8, layout, side, gather),
        low_precision_products=frozenset(fp8.products))
    sizes = {} if mesh is None else mesh_sizes(mesh)
    tensor = math.prod(sizes.get(a, 1) for a in (() if rules is None else rules.activations["heads"]))
    sequence_parallel = cfg.parallel.sequence_parallel and tensor > 1
    if sequence_parallel or (tensor > 1 and sizes.get("pipeline", 1) > 1):
        # On GPUs the sequence-parallel products run as collective matmuls (parallel.tp_comm_overlap).
        ring = cfg.parallel.tp_comm_overlap and platform in ("gpu", "cuda", "rocm")
        ops = tensor_parallel_ops(mesh, rules.activations, dot, sequence_parallel=sequence_parallel,
                                  collective_matmul=ring)
        return dataclasses.replace(ops, **low)
    return LinearOps(column=dot, row=dot, **low)


def attention_core(cfg: Config, mesh: Mesh | None, rules: ShardingRules | None) -> Callable:
    """The attention for this layout: the configured kernel, per shard under a mesh, or context-parallel
    (inside the pipeline stages, the same functions run on each device's shards)."""
    impl = cfg.model.attention_impl
    if mesh is not None and mesh_sizes(mesh)["context"] > 1:
        return context_parallel_attention(BLOCK_ATTENTION[impl], mesh, rules.activations, cfg.parallel.context_impl)
    core = make_attention_core(impl, cfg.parallel.recompute)
    if impl != "xla" and mesh is not None and mesh.devices.size > 1:
        core = sharded_attention(core, mesh, rules.activations)
    return core


def mamba_ssd(cfg: Config, mesh: Mesh | None, rules: ShardingRules | None) -> Callable | None:
    """The Mamba mixers' SSD scan: model.mamba_ssd_impl's (the chunked jnp form by default; the Pallas
    kernels per shard under a mesh); None: the model's default."""
    if cfg.model.mamba_ssd_impl == "xla":
        return None
    from pallas_kernels.ssd import ssd
    if mesh is not None and mesh.devices.size > 1:
        return sharded_ssd(ssd, mesh, rules.activations)
    return ssd


def expert_dispatch(cfg: Config, mesh: Mesh | None, rules: ShardingRules | None) -> Callable | None:
    """The MoE token dispatch for this layout: each device dispatches its own tokens to the experts'
    devices under a mesh of several devices; None (all experts local) otherwise."""
    m = cfg.model
    if not m.num_experts or mesh is None or mesh.devices.size == 1:
        return None
    platform = mesh.devices.flat[0].platform
    if cfg.parallel.moe_all_to_all == "ragged" and platform == "cpu" and \
            experts.RAGGED_ALL_TO_ALL is jax.lax.ragged_all_to_all:
        raise ConfigError("parallel.moe_all_to_all = ragged needs jax.lax.ragged_all_to_all, which XLA:CPU does "
                          "not implement (this run's devices are cpu); GPU and TPU have it. Use "
                          "parallel.moe_all_to_all=padded on CPU.")
    return experts.expert_parallel_dispatch(mesh, rules.activations, activation=m.activation,
                                            num_experts=m.num_experts, capacity_factor=m.moe_expert_capacity_factor,
                                            all_to_all=cfg.parallel.moe_all_to_all,
                                            grouped_impl=m.moe_grouped_gemm_impl,
                                            dispatcher=moe_token_dispatcher(cfg, platform))


def build_model_spec(cfg: Config, padded_vocab_size: int, *, mesh: Mesh | None = None,
                     rules: ShardingRules | None = None, seed: int | None = None) -> tuple[ModelSpec, Callable]:
    """Returns (spec, init_params) where init_params() -> pure parameter dict (call under jit)."""
    policy = precision_policy(cfg)
    dtype = policy.compute_dtype
    seed = cfg.train.seed if seed is None else seed
    ops = linear_ops(cfg, mesh, rules)
    core = attention_core(cfg, mesh, rules)
    dispatch = expert_dispatch(cfg, mesh, rules)
    shift = sequence_shift(mesh, None if rules is None else rules.activations)
    mixer = mamba_context(mesh, None if rules is None else rules.activations)
    scan = mamba_ssd(cfg, mesh, rules)

    vision = {} if cfg.model.vision is None else {"vision_dot": plain_dot(mesh)}

    def make():
        return build_model(cfg.model, padded_vocab_size=padded_vocab_size, dtype=dtype,
                           recompute=cfg.parallel.recompute, ops=ops, attention_core=core,
                           expert_dispatch=dispatch, sequence_shift=shift, sequence_mixer=mixer, ssd=scan,
                           rngs=nnx.Rngs(params=seed), **vision)

    abstract = nnx.eval_shape(make)
    graphdef, abstract_params, abstract_fp8 = nnx.split(abstract, nnx.Param, Fp8Meta)
    abstract_fp8 = nnx.to_pure_dict(abstract_fp8)
    axes, abstract_params = param_axes(abstract), nnx.to_pure_dict(abstract_params)
    frozen_axes = abstract_frozen = frozen = None
    if cfg.model.lora is not None:  # the frozen base outside the train state (megajax/models/trainable.py)
        frozen = frozen_parameters(cfg.model)
        (axes, frozen_axes), (abstract_params, abstract_frozen) = (split_frozen(axes, frozen),
                                                                   split_frozen(abstract_params, frozen))
    spec = ModelSpec(graphdef=graphdef, axes=axes, abstract_params=abstract_params,
                     abstract_fp8=abstract_fp8 or None, sequence_shift=shift, frozen_axes=frozen_axes,
                     abstract_frozen=abstract_frozen, frozen_path=frozen)
    # Layers store their parameters in fp32 and cast them to `dtype` where they are used (the train
    # state holds them in policy.param_dtype: make_init_fn).
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((spec.abstract_params, abstract_frozen))), policy

    def init_params():
        return nnx.to_pure_dict(nnx.state(make(), nnx.Param))

    return spec, init_params


def loss_scaler(cfg: Config) -> DynamicLossScale | None:
    t = cfg.train
    if not precision_policy(cfg).dynamic_loss_scale:
        return None
    return DynamicLossScale(initial_scale=t.initial_loss_scale, min_scale=t.min_loss_scale,
                            window=t.loss_scale_window, hysteresis=t.hysteresis)


def initial_expert_bias(m: ModelConfig) -> jax.Array | None:
    """The routers' expert bias at the start of training: zeros [router layers, E] fp32 (the MoE layers',
    then a mixture-of-experts MTP block's), or None when the model has none (dense, or
    model.moe_router_bias_update_rate = 0)."""
    if not has_expert_bias(m):
        return None
    return jnp.zeros((m.num_router_layers(), m.num_experts), jnp.float32)


def make_init_fn(init_params: Callable, tx: optax.GradientTransformation,
                 scaler: DynamicLossScale | None, seed: int,
                 init_fp8: Callable[[], dict | None] = lambda: None,
                 init_expert_bias: Callable[[], jax.Array | None] = lambda: None,
                 split: Callable[[dict], tuple[dict, dict | None]] = lambda p: (p, None),
                 param_dtype=jnp.float32) -> Callable[[], TrainState]:
    """The fresh train state; the optimizer is initialised on the (trainable) parameters alone, in fp32
    (its master copy of them where they are held in another `param_dtype`, precision.param_dtype).
    `split`: a whole parameter tree -> (trainable, frozen or None) (ModelSpec.split)."""
    def init() -> TrainState:
        params, frozen = split(init_params())
        opt_state = tx.init(params)
        params = jax.tree.map(lambda p: p.astype(param_dtype), params)
        return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=opt_state,
                          loss_scale=scaler.init() if scaler else None,
                          rng=jax.random.key_data(jax.random.key(seed)), fp8=init_fp8(),
                          moe_expert_bias=init_expert_bias(), frozen=frozen)
    return init


def masked_opt_shardings(opt_state, param_sh: dict, abstract_params: dict, replicated: NamedSharding):
    """The optimizer state's shardings where some parameters have no state (optax.masked): a leaf whose
    dict-key path and shape are a parameter's gets that parameter's sharding, any other (counts) is
    replicated."""
    def keys(path):
        return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))

    shardings = {keys(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        param_sh, is_leaf=lambda x: isinstance(x, NamedSharding))[0]}
    shapes = {keys(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}

    def pick(path, leaf):
        k = keys(path)
        return shardings[k] if k in shardings and shapes[k] == getattr(leaf, "shape", None) else replicated

    return jax.tree_util.tree_map_with_path(pick, opt_state)


def state_shardings(mesh: Mesh, rules: ShardingRules, spec: ModelSpec, tx: optax.GradientTransformation,
                    abstract_state: TrainState) -> TrainState:
    """NamedSharding for every leaf of the train state, from the rules tables."""
    replicated = NamedSharding(mesh, P())
    param_sh = tree_shardings(mesh, spec.axes, rules.params)
    opt_param_sh = tree_shardings(mesh, spec.axes, rules.opt_state)
    masked = any(isinstance(x, MaskedNode) for x in jax.tree.leaves(
        abstract_state.opt_state, is_leaf=lambda x: isinstance(x, MaskedNode)))
    if masked:  # frozen parameters (make_optimizer's `frozen`): moments for the trainable ones alone
        opt_sh = masked_opt_shardings(abstract_state.opt_state, opt_param_sh, spec.abstract_params, replicated)
    else:
        opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_state.opt_state, opt_param_sh,
                                       transform_non_params=lambda _: replicated,
                                       is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh,
                      loss_scale=jax.tree.map(lambda _: replicated, abstract_state.loss_scale),
                      rng=replicated,
                      # A few scalars per product, used by every device: replicated.
                      fp8=jax.tree.map(lambda _: replicated, abstract_state.fp8),
                      # [layers, E] fp32, read by every device's routers: replicated.
                      moe_expert_bias=jax.tree.map(lambda _: replicated, abstract_state.moe_expert_bias),
                      frozen=None if spec.frozen_axes is None else tree_shardings(mesh, spec.frozen_axes, rules.params))


# The train state between steps is stored with its data-parallel splits padded (megajax/mesh.py
# PADDED_AXES); `target` below is a tree of logical ShapeDtypeStructs carrying their shardings.

def pad_state(tree, target):
    """A tree of logical arrays (numpy or jax) as stored: each zero-padded to padded_shape."""
    return jax.tree.map(lambda x, t: pad_to(x, padded_shape(t.shape, t.sharding)), tree, target)


def unpad_state(tree, target):
    """A stored tree (pad_state) at its logical shapes again (inside a jitted step: XLA keeps the uneven
    splits)."""
    return jax.tree.map(lambda x, t: unpad_to(x, tuple(t.shape)), tree, target)


def place(x, t: jax.ShapeDtypeStruct) -> jax.Array:
    """A host array of logical struct `t` (shape, dtype, sharding) on the devices as stored (pad_state)."""
    return jax.device_put(pad_to(np.asarray(x, t.dtype), padded_shape(t.shape, t.sharding)), t.sharding)

