"""Train state and its shardings.

TrainState holds everything a step changes: step counter, fp32 parameters
(a nested dict mirroring the model), optimizer state, the fp16 loss scale,
and the RNG key data. Shardings of every leaf come from the rules tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.config import Config
from megajax.mesh import ShardingRules, tree_shardings
from megajax.models import Transformer, param_axes
from megajax.errors import ConfigError
from megajax.models.attention import BLOCK_ATTENTION, make_attention_core
from megajax.models.layers import LinearOps, flat_dot_general
from megajax.parallel.context import context_parallel_attention, sharded_attention
from megajax.parallel.experts import expert_parallel_dispatch
from megajax.parallel.sequence import sequence_parallel_ops
from megajax.precision.loss_scale import DynamicLossScale, LossScaleState

COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


@struct.dataclass
class TrainState:
    step: jax.Array  # i32 []
    params: dict
    opt_state: optax.OptState
    loss_scale: LossScaleState | None
    rng: jax.Array  # u32 [2] (raw key data)


@dataclass
class ModelSpec:
    """Everything needed to run the model functionally: graphdef + parameter metadata."""
    graphdef: Any
    axes: dict  # logical axes per parameter (same tree as params)
    abstract_params: dict  # ShapeDtypeStructs

    def apply(self, params: dict, *args, **kwargs) -> jax.Array:
        return nnx.merge(self.graphdef, params)(*args, **kwargs)


def linear_ops(cfg: Config, mesh: Mesh | None, rules: ShardingRules | None) -> LinearOps:
    """The model's injected products for this layout (sequence parallel or plain) and back end."""
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    dot = flat_dot_general() if platform == "cpu" else jax.lax.dot_general
    if (mesh is not None and cfg.parallel.sequence_parallel
            and dict(zip(mesh.axis_names, mesh.devices.shape))["tensor"] > 1):
        return sequence_parallel_ops(mesh, rules.activations, dot)
    return LinearOps(column=dot, row=dot)


def attention_core(cfg: Config, mesh: Mesh | None, rules: ShardingRules | None) -> Callable:
    """The attention for this layout: the configured kernel, per shard under a mesh, or context-parallel."""
    impl = cfg.model.attention_impl
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    if impl == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention_impl = 'cudnn' needs an NVIDIA GPU; this run's devices are "
                          f"{platform}. Use model.attention_impl=flash or xla.")
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape)) if mesh is not None else {}
    if sizes.get("context", 1) > 1:
        return context_parallel_attention(BLOCK_ATTENTION[impl], mesh, rules.activations,
                                          cfg.parallel.context_impl)
    core = make_attention_core(impl, cfg.parallel.recompute)
    if impl != "xla" and mesh is not None and mesh.devices.size > 1:
        core = sharded_attention(core, mesh, rules.activations)
    return core


def expert_dispatch(cfg: Config, mesh: Mesh | None, rules: ShardingRules | None) -> Callable | None:
    """The MoE token dispatch for this layout: each device dispatches its own tokens to the experts'
    devices under a mesh of several devices; None (all experts local) otherwise."""
    m = cfg.model
    if not m.num_experts or mesh is None or mesh.devices.size == 1:
        return None
    return expert_parallel_dispatch(mesh, rules.activations, activation=m.activation, num_experts=m.num_experts,
                                    capacity_factor=m.moe_expert_capacity_factor)


def build_model_spec(cfg: Config, padded_vocab_size: int, *, mesh: Mesh | None = None,
                     rules: ShardingRules | None = None, seed: int | None = None) -> tuple[ModelSpec, Callable]:
    """Returns (spec, init_params) where init_params() -> pure parameter dict (call under jit)."""
    dtype = COMPUTE_DTYPES[cfg.train.precision]
    seed = cfg.train.seed if seed is None else seed
    ops = linear_ops(cfg, mesh, rules)
    core = attention_core(cfg, mesh, rules)
    dispatch = expert_dispatch(cfg, mesh, rules)

    def make():
        return Transformer(cfg.model, padded_vocab_size=padded_vocab_size, dtype=dtype,
                           recompute=cfg.parallel.recompute, ops=ops, attention_core=core,
                           expert_dispatch=dispatch, rngs=nnx.Rngs(params=seed))

    abstract = nnx.eval_shape(make)
    graphdef, abstract_state = nnx.split(abstract)
    spec = ModelSpec(graphdef=graphdef, axes=param_axes(abstract),
                     abstract_params=nnx.to_pure_dict(abstract_state))

    def init_params():
        return nnx.to_pure_dict(nnx.state(make()))

    return spec, init_params


def loss_scaler(cfg: Config) -> DynamicLossScale | None:
    t = cfg.train
    if t.precision != "fp16":
        return None
    return DynamicLossScale(initial_scale=t.initial_loss_scale, min_scale=t.min_loss_scale,
                            window=t.loss_scale_window, hysteresis=t.hysteresis)


def make_init_fn(init_params: Callable, tx: optax.GradientTransformation,
                 scaler: DynamicLossScale | None, seed: int) -> Callable[[], TrainState]:
    def init() -> TrainState:
        params = init_params()
        return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                          loss_scale=scaler.init() if scaler else None,
                          rng=jax.random.key_data(jax.random.key(seed)))
    return init


def state_shardings(mesh: Mesh, rules: ShardingRules, spec: ModelSpec, tx: optax.GradientTransformation,
                    abstract_state: TrainState) -> TrainState:
    """NamedSharding for every leaf of the train state, from the rules tables."""
    replicated = NamedSharding(mesh, P())
    param_sh = tree_shardings(mesh, spec.axes, rules.params)
    opt_param_sh = tree_shardings(mesh, spec.axes, rules.opt_state)
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_state.opt_state, opt_param_sh,
                                   transform_non_params=lambda _: replicated,
                                   is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh,
                      loss_scale=jax.tree.map(lambda _: replicated, abstract_state.loss_scale),
                      rng=replicated)
