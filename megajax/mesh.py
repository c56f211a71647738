"""Device mesh from config, and the logical-axis -> mesh-axis rules tables.

Mesh axes, outermost to innermost: pipeline, data, fsdp, expert, context,
tensor. Model code only names logical axes (`embed`, `heads`, `mlp`, ...);
the tables below decide where each goes. Parallel strategies are entries in
these tables:

- data parallel: activations' `batch` over `data` (and `fsdp`);
- FSDP (ZeRO-3): parameters' `embed` over `fsdp`;
- distributed optimizer (ZeRO-1): optimizer state's `embed` over `data`
  (and `fsdp`), parameters left replicated over `data`; both at any size
  (stored padded where they do not divide: PADDED_AXES);
- tensor parallel: `heads`, `kv_heads`, `mlp`, `vocab` over `tensor`
  (Megatron's column/row splits follow from the weight layouts);
- sequence parallel: activations' `residual_length` (the sequence dim outside
  tensor-parallel regions) over `tensor`;
- context parallel: the sequence (`length`, `residual_length`) over `context`
  (attention itself is in megajax/parallel/context.py);
- expert parallel: MoE kernels' `experts` over `expert`; outside the MoE layers
  `expert` splits the batch like `data` (token dispatch: megajax/parallel/experts.py);
  with parallel.expert_tensor_parallel=1 (MoE parallel folding) over `expert`, `context` and
  `tensor`, the experts' hidden dim `expert_mlp` whole (else over `tensor`, as `mlp`);
- pipeline parallel: the stacked blocks' `layers` over `pipeline` (stage s holds
  a consecutive run of layers; the schedules are in megajax/parallel/pipeline.py);
  the `stack`s (a dense-first model's dense layers, the multi-token prediction
  depths) are whole on every stage; what one stage alone runs is kept split over
  `pipeline` between steps: a vision-language model's encoder (encoder_storage_axes),
  the embedding and the output layer (vocab_storage_axes).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.config import MESH_AXES, Config, expert_tensor_folded
from megajax.errors import MeshError

Rules = Mapping[str, tuple[str, ...]]


# ----------------------------------------------------------------------------
# Mesh
# ----------------------------------------------------------------------------

def axis_sizes(cfg: Config, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """(per-node sizes, inter-node factors) of every axis, with -1 filled in."""
    dcn = {a: getattr(cfg.mesh.dcn, a) for a in MESH_AXES}
    num_slices = math.prod(dcn.values())
    if num_devices % num_slices:
        raise MeshError(f"mesh.dcn asks for {num_slices} nodes ({_fmt(dcn)}) but {num_devices} devices "
                        f"do not split evenly into {num_slices} nodes.")
    per_slice = num_devices // num_slices
    ici = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    fixed = math.prod(v for v in ici.values() if v != -1)
    fill = [a for a, v in ici.items() if v == -1]
    if fill:
        if per_slice % fixed:
            raise MeshError(f"mesh {_fmt({a: v for a, v in ici.items() if v != -1})} uses {fixed} devices "
                            f"per node, which does not divide the {per_slice} devices available per node; "
                            f"mesh.{fill[0]}=-1 cannot be filled. Change the fixed sizes.")
        ici[fill[0]] = per_slice // fixed
    elif fixed != per_slice:
        raise MeshError(f"mesh {_fmt(ici)} uses {fixed} devices per node but {per_slice} are available"
                        f"{' per node' if num_slices > 1 else ''}; set one axis to -1 (e.g. mesh.data=-1) "
                        f"or change the sizes so their product is {per_slice}.{_cpu_hint(fixed * num_slices)}")
    return ici, dcn


def _fmt(sizes: Mapping[str, int]) -> str:
    shown = [f"{a}={v}" for a, v in sizes.items() if v != 1] or ["all axes 1"]
    return " x ".join(shown)


def _cpu_hint(wanted: int) -> str:
    """On a CPU-only machine: how to get more (simulated) devices."""
    try:
        cpu = jax.devices()[0].platform == "cpu"
    except RuntimeError:
        cpu = False
    if not cpu:
        return ""
    return (f" On a CPU, simulate devices with mesh.cpu_devices={wanted} (or "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={wanted} before starting).")


def make_mesh(cfg: Config, devices: list | None = None) -> Mesh:
    """The 6-axis mesh of `cfg` over `devices` (default: all)."""
    devices = list(devices if devices is not None else jax.devices())
    return mesh_from_sizes(*axis_sizes(cfg, len(devices)), devices)


def mesh_from_sizes(ici: Mapping[str, int], dcn: Mapping[str, int], devices: list) -> Mesh:
    """Builds the mesh (axis type Auto) for per-node sizes `ici` and inter-node factors `dcn`;
    hybrid across nodes when some factor is > 1."""
    shape = tuple(ici[a] for a in MESH_AXES)
    dcn_shape = tuple(dcn[a] for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if math.prod(dcn_shape) == 1:
        try:
            return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
        except Exception:  # e.g. a device subset make_mesh cannot lay out physically
            return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)
    from jax.experimental import mesh_utils
    granule_by_process = not hasattr(devices[0], "slice_index")
    try:
        dev_array = mesh_utils.create_hybrid_device_mesh(
            shape, dcn_shape, devices, process_is_granule=granule_by_process)
    except ValueError:
        # The devices do not come in as many processes/slices as mesh.dcn asks for (e.g.
        # simulated CPU devices in one process): treat contiguous device groups as nodes.
        dev_array = emulated_hybrid_mesh(devices, shape, dcn_shape)
    return Mesh(dev_array, MESH_AXES, axis_types=auto)


def emulated_hybrid_mesh(devices: list, ici_shape: tuple[int, ...], dcn_shape: tuple[int, ...]) -> np.ndarray:
    """Device array where axis i = dcn_shape[i] (outer, node groups) x ici_shape[i] (inner)."""
    n = len(ici_shape)
    grid = np.asarray(devices).reshape(dcn_shape + ici_shape)
    grid = grid.transpose([j for i in range(n) for j in (i, n + i)])
    return grid.reshape(tuple(d * i for d, i in zip(dcn_shape, ici_shape)))


def mesh_sizes(mesh) -> dict[str, int]:
    """Axis name -> size of a Mesh or an AbstractMesh (the one in context inside shard_map)."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


# The mesh axes that split the batch: each of their ranks holds a different part of the global batch.
# Expert-parallel ranks are data-parallel ranks outside the MoE layers, as in Megatron.
BATCH_AXES = ("data", "fsdp", "expert")


def mesh_text(sizes: Mapping[str, int]) -> str:
    """Axis sizes as a user reads them: 'data=2 x tensor=4' (axes of size 1 left out), or '1 device'."""
    return " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "1 device"


def data_parallel_size(sizes: Mapping[str, int]) -> int:
    """Ranks that split the batch (the product of BATCH_AXES, the activations' `batch` rule)."""
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def model_dims(cfg: Config) -> dict[str, list[tuple[str, int]]]:
    """The model's sizes by logical dim: {dim: [(config key, size), ...]} for every dim a rules table
    may split (the padded vocabulary under `vocab`)."""
    m = cfg.model
    dims = {"heads": [("model.num_heads", m.num_heads)], "kv_heads": [("model.num_kv_heads", m.num_kv_heads)],
            "mlp": [("model.ffn_hidden_size", m.ffn_hidden_size)], "embed": [("model.hidden_size", m.hidden_size)]}
    if m.num_experts:
        dims["experts"] = [("model.num_experts", m.num_experts)]
        dims["expert_mlp"] = [("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size)]
        dims["mlp"] += [("model.moe_shared_expert_ffn_size", m.moe_shared_expert_ffn_size)]
    if m.vocab_size is not None:
        dims["vocab"] = [("model.vocab_size", m.padded_vocab_size())]
    if m.vision is not None:  # the image encoder's (and its projector's, to the language model's width)
        v = m.vision
        dims["vision_heads"] = [("model.vision.num_heads", v.num_heads)]
        dims["vision_mlp"] = [("model.vision.ffn_hidden_size", v.ffn_hidden_size), ("model.hidden_size", m.hidden_size)]
        dims["embed"].append(("model.vision.hidden_size", v.hidden_size))
    if "M" in m.hybrid_pattern():  # the Mamba mixers' heads and B/C groups
        dims["heads"].append(("model.mamba_num_heads", m.mamba_num_heads))
        dims["ssm_groups"] = [("model.mamba_num_groups", m.mamba_num_groups)]
    return dims


def validate_for_model(cfg: Config, sizes: Mapping[str, int], rules: "ShardingRules | None" = None) -> None:
    """Checks that the model and the sequence split evenly over mesh axis sizes `sizes`.

    Which sizes must divide which is read from the rules tables (`rules`, default make_rules(cfg)):
    every model dim of `model_dims` over the product of the mesh axes its parameter, optimizer-state
    and activation rules name (e.g. `heads` over mesh.tensor, `experts` over mesh.expert). The
    stored state's splits over PADDED_AXES (`embed` over mesh.fsdp, and with the distributed
    optimizer over mesh.data x mesh.fsdp) need not divide: those dims are padded (padded_shape)."""
    s = sizes
    rules = rules or make_rules(cfg, sizes)
    t = cfg.train
    tp = s["tensor"]
    tables = (("", rules.params, PADDED_AXES), (" (distributed optimizer)", rules.opt_state, PADDED_AXES),
              ("", rules.activations, ()))
    for dim, entries in model_dims(cfg).items():
        for why, table, padded in tables:
            axes = [a for a in table.get(dim, ()) if s.get(a, 1) > 1 and a not in padded]
            size = math.prod(s[a] for a in axes)
            for key, value in entries:
                if not value % size:
                    continue
                axis = " x ".join(f"mesh.{a}" for a in axes) + why
                if dim == "vocab":
                    m = cfg.model
                    multiple = math.lcm(m.make_vocab_size_divisible_by, size)
                    raise MeshError(f"{axis}={size} does not divide the padded vocabulary {value} "
                                    f"(model.vocab_size={m.vocab_size} rounded up to a multiple of "
                                    f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by}); set "
                                    f"model.make_vocab_size_divisible_by to a multiple of {size}, e.g. {multiple}.")
                raise MeshError(f"{key}={value} is not divisible by {axis}={size}; change {axis} "
                                f"(sizes that divide it and the {math.prod(s.values())} devices: "
                                f"{_divisors(value, size, math.prod(s.values()))}) or {key}.")
    enc = cfg.parallel.encoder_tensor_parallel
    if enc not in (0, 1, tp):
        raise MeshError(f"parallel.encoder_tensor_parallel={enc} with mesh.tensor={tp}: the encoder and projector "
                        f"split over all of the tensor axis or none of it; accepted: 1 (whole on every tensor rank) "
                        f"or {tp} (0: the same as mesh.tensor). A size in between would split it over part "
                        f"of the one `tensor` mesh axis, which a sharding cannot name (Megatron puts such an "
                        f"encoder on ranks of its own).")
    c = s["context"]
    if c > 1 and t.seq_len % (2 * c):
        devices = math.prod(s.values())
        ok = [k for k in range(1, min(t.seq_len // 2, devices) + 1)
              if t.seq_len % (2 * k) == 0 and devices % k == 0 and k != c][:12]
        lengths = [n for n in ((t.seq_len // (2 * c)) * 2 * c, -(-t.seq_len // (2 * c)) * 2 * c) if n]
        raise MeshError(f"train.seq_len={t.seq_len} does not split over mesh.context={c}: context parallelism "
                        f"cuts the sequence into 2 x context chunks, so seq_len must be a multiple of "
                        f"{2 * c}. Context sizes that work for this seq_len and the {devices} devices: "
                        f"{', '.join(map(str, ok)) or 'none'}; or train.seq_len="
                        f"{' or train.seq_len='.join(map(str, lengths))}.")
    heads = cfg.model.mamba_num_heads
    if c > 1 and "M" in cfg.model.hybrid_pattern() and heads % (tp * c):
        raise MeshError(f"model.mamba_num_heads={heads} is not divisible by mesh.tensor x mesh.context = {tp * c}: "
                        f"under context parallelism a Mamba layer's conv and scan run on whole sequences of "
                        f"1 / context of each tensor shard's heads; change the mesh or model.mamba_num_heads.")
    if expert_tensor_folded(cfg) and cfg.model.num_experts and not cfg.parallel.sequence_parallel \
            and t.seq_len % (tp * c):
        raise MeshError(f"train.seq_len={t.seq_len} is not divisible by mesh.tensor x mesh.context = {tp * c}: with "
                        f"parallel.expert_tensor_parallel={cfg.parallel.expert_tensor_parallel} and no sequence "
                        f"parallelism each tensor rank dispatches 1 / tensor of its sequence to the experts; "
                        f"change train.seq_len or the mesh, or set parallel.sequence_parallel=true.")
    if cfg.parallel.sequence_parallel and t.seq_len % (tp * c):
        raise MeshError(f"train.seq_len={t.seq_len} is not divisible by mesh.tensor x mesh.context = {tp * c} "
                        f"(sequence parallelism splits the sequence over both); change train.seq_len or the mesh.")


# ----------------------------------------------------------------------------
# The train state as stored between steps: data-parallel splits padded
# ----------------------------------------------------------------------------

# The mesh axes that split the stored train state (FSDP's parameters, the distributed optimizer's
# state) without the computation depending on how: a dim they split need not be a multiple of their
# size. It is stored padded with zeros to the next multiple (as Megatron's distributed optimizer pads
# its flat buffer), and the train step works on the dim's first `n` entries, where XLA keeps the uneven
# split (its per-device shards are the padded array's own; neither the slice nor the pad moves data).
PADDED_AXES = ("data", "fsdp")


def split_counts(sharding: NamedSharding, ndim: int) -> tuple[int, ...]:
    """How many pieces `sharding` cuts each of an array's `ndim` dims into."""
    sizes = mesh_sizes(sharding.mesh)
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(math.prod(sizes[a] for a in entry_axes(e)) for e in spec[:ndim])


def padded_shape(shape: tuple[int, ...], sharding) -> tuple[int, ...]:
    """`shape` with every dim rounded up to a multiple of the pieces `sharding` cuts it into (the shape
    an array of logical shape `shape` is stored in); `shape` itself without a NamedSharding."""
    if not isinstance(sharding, NamedSharding):
        return tuple(shape)
    return tuple(-(-n // k) * k for n, k in zip(shape, split_counts(sharding, len(shape))))


def padded_struct(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """A logical ShapeDtypeStruct (with its sharding) as stored: padded_shape."""
    return jax.ShapeDtypeStruct(padded_shape(x.shape, x.sharding), x.dtype, sharding=x.sharding,
                                weak_type=getattr(x, "weak_type", False))


def pad_to(x, shape: tuple[int, ...]):
    """`x` zero-padded at the end of each dim to `shape` (itself when it has that shape); numpy arrays
    stay numpy (padded on the host)."""
    if tuple(x.shape) == tuple(shape):
        return x
    widths = [(0, s - n) for n, s in zip(x.shape, shape)]
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def unpad_to(x, shape: tuple[int, ...]):
    """The first `shape` entries of each dim of `x` (itself when it has that shape)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, n) for n in shape)]


def even_sharding(sharding, shape: tuple[int, ...]):
    """`sharding` without the mesh axes that do not divide their dim of `shape` (that dim whole on
    them): the layout of the logical array outside a train step, e.g. for generation."""
    if not isinstance(sharding, NamedSharding) or padded_shape(shape, sharding) == tuple(shape):
        return sharding
    sizes = mesh_sizes(sharding.mesh)
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    entries = []
    for n, entry in zip(shape, spec):
        kept = []
        for a in entry_axes(entry):
            if n % (math.prod(sizes[k] for k in kept) * sizes[a]) == 0:
                kept.append(a)
        entries.append(spec_entry(kept))
    return NamedSharding(sharding.mesh, P(*entries))


def _divisors(value: int, size: int, devices: int) -> str:
    """The other mesh sizes that divide both `value` and the device count."""
    common = math.gcd(value, devices)  # a divisor of both divides their gcd
    return ", ".join(str(d) for d in range(1, common + 1) if common % d == 0 and d != size)


# ----------------------------------------------------------------------------
# Rules tables
# ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardingRules:
    """Logical -> mesh axis tables for parameters, optimizer state and activations."""
    params: Rules
    opt_state: Rules
    activations: Rules


# The routed experts' split under MoE parallel folding (parallel.expert_tensor_parallel=1 below the
# tensor size): the experts over these axes (the innermost three, so an expert group is a run of
# neighbouring devices, as Megatron's expert ranks), each expert's hidden dim whole.
FOLDED_EXPERT_AXES = ("expert", "context", "tensor")


def expert_axes(cfg: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the mesh axes of the routed experts' `experts` dim, of their hidden dim `expert_mlp`)."""
    if expert_tensor_folded(cfg):
        return FOLDED_EXPERT_AXES, ()
    return ("expert",), ("tensor",)


def encoder_tensor_axes(cfg: Config) -> tuple[str, ...]:
    """The mesh axes a vision-language model's encoder and projector split over like the language
    model's heads and MLP: `tensor`, or none with parallel.encoder_tensor_parallel=1 (whole on every
    tensor rank; other sizes refused in validate_for_model)."""
    return () if cfg.parallel.encoder_tensor_parallel == 1 else ("tensor",)


def encoder_storage_axes(cfg: Config, sizes: Mapping[str, int] | None = None) -> dict[str, tuple[str, ...]]:
    """Where a vision-language model's encoder and projector weights (and their optimizer state) are
    kept between steps: {`vision_heads`, `vision_mlp`: mesh axes}. Their tensor split (`tensor`, or
    none with parallel.encoder_tensor_parallel=1), and under pipeline parallelism `pipeline` too:
    only the first stage runs them, so the stages share one copy, 1 / stages each, gathered for
    the step (megajax/train/pipeline_step.py). A dim whose sizes (model_dims) the split does not
    divide stays whole over `pipeline` (every stage then keeps a copy). `sizes`: the mesh's
    (default: the config's fixed sizes)."""
    if sizes is None:
        sizes = {a: max(getattr(cfg.mesh, a), 1) * getattr(cfg.mesh.dcn, a) for a in ("pipeline", "tensor")}
    encoder = encoder_tensor_axes(cfg)
    out = {"vision_heads": encoder, "vision_mlp": encoder}
    if cfg.model.vision is None or sizes.get("pipeline", 1) == 1:
        return out
    dims = model_dims(cfg)
    for dim, axes in out.items():
        split = math.prod(sizes.get(a, 1) for a in (*axes, "pipeline"))
        if all(value % split == 0 for _, value in dims[dim]):
            out[dim] = (*axes, "pipeline")
    return out


def vocab_storage_axes(cfg: Config, sizes: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """Where the parameters with a vocabulary dim (the embedding table, the output layer) and their
    optimizer state are kept between steps: over `tensor` (vocabulary parallelism), and under
    pipeline parallelism over `pipeline` too. Only the first stage runs the embedding and only the
    last the output layer, so the stages share one copy, 1 / stages each, gathered for the step
    (megajax/train/pipeline_step.py; a tied embedding serves both ends from the one copy). A padded
    vocabulary the split does not divide stays whole over `pipeline`. `sizes`: the mesh's (default:
    the config's fixed sizes)."""
    if sizes is None:
        sizes = {a: max(getattr(cfg.mesh, a), 1) * getattr(cfg.mesh.dcn, a) for a in ("pipeline", "tensor")}
    pp, tp = sizes.get("pipeline", 1), sizes.get("tensor", 1)
    vocab = cfg.model.padded_vocab_size() if cfg.model.vocab_size is not None else None
    if pp == 1 or vocab is None or vocab % (pp * tp):
        return ("tensor",)
    return ("tensor", "pipeline")


def make_rules(cfg: Config, sizes: Mapping[str, int] | None = None) -> ShardingRules:
    """The rules tables of `cfg` on a mesh of `sizes` (default: the config's fixed sizes; only the
    storage over `pipeline` of what one stage alone runs depends on them: encoder_storage_axes,
    vocab_storage_axes)."""
    experts, expert_mlp = expert_axes(cfg)
    tensor_dims = {"vocab": ("tensor",), "heads": ("tensor",), "kv_heads": ("tensor",),
                   "mlp": ("tensor",), "ssm_groups": ("tensor",), "expert_mlp": expert_mlp}
    tensor_dims |= {"vision_heads": encoder_tensor_axes(cfg), "vision_mlp": encoder_tensor_axes(cfg)}
    params = {**tensor_dims, **encoder_storage_axes(cfg, sizes), "vocab": vocab_storage_axes(cfg, sizes),
              "embed": ("fsdp",), "head_dim": (), "layers": (), "stack": (), "position": (),
              "ssm_state": (), "conv": (),
              # Low-rank adapters (megajax/models/lora.py): the rank dim replicated, the fused q/k/v
              # and gate/up slots of a B beside their kernels' kv-head and mlp dims, a Mamba in_proj B's
              # per-group z | x | B | C | dt columns beside its group dim.
              "lora_rank": (), "qkv_slot": (), "gate_up": (), "in_proj_part": (),
              "experts": experts, "expert_scores": (), "stage": ("pipeline",)}
    if cfg.mesh.pipeline != 1 or cfg.mesh.dcn.pipeline != 1:
        params["layers"] = ("pipeline",)
    opt_state = dict(params)
    if cfg.parallel.distributed_optimizer:
        opt_state["embed"] = ("data", "fsdp")
    activations = {
        **tensor_dims,
        "batch": BATCH_AXES,
        "experts": experts,
        "expert_scores": (),
        "length": ("context",),  # sequence inside tensor-parallel regions
        "residual_length": ("context", "tensor") if cfg.parallel.sequence_parallel else ("context",),
        "embed": (),
        "head_dim": (),
        "ssm_state": (),
        "conv": (),
        "layers": (),  # the KV cache's leading dim (generation)
        "cache_length": (),  # the KV cache's slots: every device holds all of its sequences' slots
    }
    return ShardingRules(params=params, opt_state=opt_state, activations=activations)


def logical_to_spec(names: tuple[str | None, ...], rules: Rules) -> P:
    """PartitionSpec for logical dim names; a mesh axis is used at most once (first dim wins)."""
    used: set[str] = set()
    out: list[Any] = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no entry in the rules table {sorted(rules)}")
        axes = tuple(a for a in rules[name] if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def named_sharding(mesh: Mesh, names: tuple[str | None, ...], rules: Rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules))


def tree_specs(axes_tree: Any, rules: Rules) -> Any:
    """Maps a pytree of logical-axes tuples to PartitionSpecs."""
    return jax.tree.map(lambda names: logical_to_spec(names, rules), axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def tree_shardings(mesh: Mesh, axes_tree: Any, rules: Rules) -> Any:
    """Maps a pytree of logical-axes tuples to NamedShardings."""
    return jax.tree.map(lambda names: named_sharding(mesh, names, rules), axes_tree,
                        is_leaf=lambda x: isinstance(x, tuple))


# ----------------------------------------------------------------------------
# Activation constraints (used by model code through logical names only)
# ----------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("megajax_activation_rules", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules: Rules | None):
    """Within this context (while tracing), `logical_constraint` pins activations to the mesh."""
    token = _ACTIVE.set((mesh, rules) if mesh is not None else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def spec_entry(axes) -> str | tuple | None:
    """A PartitionSpec entry for some mesh axes: None, one name or a tuple of names."""
    axes = tuple(axes or ())
    return None if not axes else axes[0] if len(axes) == 1 else axes


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def spec_axes(spec) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec uses."""
    return tuple(a for e in spec for a in entry_axes(e))


def _drop(entry, axes: set):
    """A PartitionSpec entry without the given mesh axes."""
    return spec_entry(n for n in entry_axes(entry) if n not in axes)


def spec_without(spec, axes) -> tuple:
    """A PartitionSpec's entries with the given mesh axes removed."""
    return tuple(_drop(entry, set(axes)) for entry in spec)


def logical_constraint(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """with_sharding_constraint by logical dim names; the identity when no mesh is active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(names, rules)
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        # Inside shard_map over some axes (a pipeline stage, and its data shard): the constraint
        # names the other axes of the context's mesh.
        manual = set(context.manual_axes)
        if manual >= set(context.axis_names):  # manual over every axis: each device holds its own shard
            return x
        spec = P(*(_drop(entry, manual) for entry in spec))
        return jax.lax.with_sharding_constraint(x, NamedSharding(context, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def fp8_param_gather(mesh: Mesh, axes: tuple[str, ...]) -> Callable[[jax.Array, int], jax.Array]:
    """gather(w8, dim): a float8 weight computed from a parameter sharded over `axes` (FSDP's
    `embed` split) along `dim`, pinned to those shards (so it is quantized where the parameter lies)
    and then to the whole dim: the all-gather moves one byte a value (the float8 bits as uint8,
    which XLA:CPU too gathers as bytes). Other dims are left to the partitioner; inside a shard_map
    the manual axes are dropped (the identity where all of `axes` are manual)."""
    def gather(w8: jax.Array, dim: int) -> jax.Array:
        context = jax.sharding.get_abstract_mesh()
        manual = set(() if context.empty else context.manual_axes)
        sizes = mesh_sizes(mesh)
        split = tuple(a for a in axes if a not in manual and sizes.get(a, 1) > 1)
        if not split:
            return w8
        target = context if manual else mesh
        bits = jax.lax.bitcast_convert_type(w8, jnp.uint8)
        spec = [P.UNCONSTRAINED] * w8.ndim
        spec[dim] = spec_entry(split)
        bits = jax.lax.with_sharding_constraint(bits, NamedSharding(target, P(*spec)))
        spec[dim] = None
        bits = jax.lax.with_sharding_constraint(bits, NamedSharding(target, P(*spec)))
        return jax.lax.bitcast_convert_type(bits, w8.dtype)
    return gather


def load_balanced_order(seq_len: int, size: int) -> np.ndarray:
    """Context parallelism's token order along the sequence for `size` context devices: the
    sequence cut into 2 x size chunks, device r holding chunks r and 2 size - 1 - r (so that under
    causal masking every device does the same work). The loader lays the batch out this way."""
    chunks = np.arange(seq_len).reshape(2 * size, seq_len // (2 * size))
    order = [i for r in range(size) for i in (r, 2 * size - 1 - r)]
    return chunks[order].reshape(-1)


def one_device_positions(names: tuple[str | None, ...], shape: tuple[int, ...]):
    """Where the elements of an activation traced here (logical dims `names`, shape `shape`) sit
    in the activation one device would compute, by the active activation rules: (that
    activation's shape, per dim None (the same elements), an int start (a contiguous block: the
    shard of a manual axis) or int32 indices [n] (context parallelism's load-balanced order,
    `load_balanced_order`)). None without active rules (one device)."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    context = jax.sharding.get_abstract_mesh()
    manual = set(() if context.empty else context.manual_axes)
    sizes = mesh_sizes(mesh if context.empty else context)
    reordering = [a for a in rules["length"] if sizes.get(a, 1) > 1]
    spec = tuple(logical_to_spec(names, rules))
    whole, where = [], []
    for n, entry in zip(shape, spec + (None,) * (len(shape) - len(spec))):
        axes = [a for a in entry_axes(entry) if sizes.get(a, 1) > 1]
        block, count = 0, 1
        for a in axes:  # major to minor
            if a in manual:
                block, count = block * sizes[a] + jax.lax.axis_index(a), count * sizes[a]
        whole.append(n * count)
        if any(a in reordering for a in axes):
            order = jnp.asarray(load_balanced_order(n * count, math.prod(sizes[a] for a in reordering)), jnp.int32)
            where.append(jax.lax.dynamic_slice_in_dim(order, block * n, n) if count > 1 else order)
        else:
            where.append(block * n if count > 1 else None)
    return tuple(whole), tuple(where)


def manual_split_axes(names: tuple[str | None, ...], dim: int) -> tuple[str, ...]:
    """The manual mesh axes (of size > 1, major to minor) that split dim `dim` of an activation
    traced here with logical dims `names`: what one device holds a shard of (empty outside shard_map)."""
    active, context = _ACTIVE.get(), jax.sharding.get_abstract_mesh()
    if active is None or context.empty:
        return ()
    sizes, manual = mesh_sizes(context), set(context.manual_axes)
    entry = tuple(logical_to_spec(names, active[1]))[dim]
    return tuple(a for a in entry_axes(entry) if a in manual and sizes.get(a, 1) > 1)


# Inside shard_map: the manual axes a value varies over (the MoE products and parallel/ use these).

def varying_axes(x) -> frozenset:
    """The manual mesh axes a traced value is typed as varying over (empty outside shard_map)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(t, "vma", ()))


def like(g, *primals):
    """`g` typed as varying over the manual mesh axes any of `primals` varies over (inside a
    shard_map, values built from constants are typed invariant; a branch's outputs must match)."""
    want = set().union(*(varying_axes(p) for p in primals))
    missing = tuple(sorted(want - varying_axes(g)))
    return jax.lax.pcast(g, missing, to="varying") if missing else g


def alike(*trees):
    """`trees` with every leaf typed as varying over each manual mesh axis any leaf varies over: the
    operands of a custom vjp inside a shard_map (the sums of their gradients over the axes only some
    of them vary over then happen outside it)."""
    leaves = jax.tree.leaves(trees)
    return jax.tree.map(lambda a: like(a, *leaves), trees)
