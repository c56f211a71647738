"""Megatron-Core's hybrid model (MambaModel built with the Mamba stack's Transformer Engine spec,
megatron/core/models/mamba/mamba_layer_specs.py) in Megatron's checkpoint formats: its tensor names,
the args it saves, and how its Mamba mixers are split over tensor ranks.

One layer per pattern character (megatron/core/ssm/mamba_block.py, MambaStack); every layer's norm
is fused into its first linear (TELayerNormColumnParallelLinear), except a mixture of experts'
(TENorm). With d_in = heads x head_dim (H x P), G groups of state N, conv width K:

    M  decoder.layers.{i}.mixer.in_proj.layer_norm_weight  [D]
       decoder.layers.{i}.mixer.in_proj.weight   [2 d_in + 2 G N + H, D]  [z; x; B; C; dt] per tensor rank
       decoder.layers.{i}.mixer.conv1d.weight    [d_in + 2 G N, 1, K]    [x; B; C] per tensor rank (and .bias)
       decoder.layers.{i}.mixer.A_log, .D, .dt_bias  [H];  .norm.weight [d_in]  (split by heads)
       decoder.layers.{i}.mixer.out_proj.weight  [D, d_in]               row-parallel
    *  decoder.layers.{i}.self_attention.linear_qkv.{layer_norm_weight, weight}, .linear_proj.weight
    -  decoder.layers.{i}.mlp.linear_fc1.{layer_norm_weight, weight}, mlp.linear_fc2.weight
    E  decoder.layers.{i}.pre_mlp_layernorm.weight, mlp.router.weight (and .expert_bias), the experts and the
       shared experts (a GPT MoE layer's names)
       decoder.final_norm.weight, embedding.word_embeddings.weight, output_layer.weight

Tensor parallelism splits in_proj and conv1d part by part (MambaMixer builds each rank's in_proj
with its own heads' z, x and dt and its own groups' B and C, and its conv over its x, B, C), so a
rank's slice is [z_r; x_r; B_r; C_r; dt_r], not a contiguous block of the whole: `groups="tensor"`
rows, as SwiGLU's linear_fc1. In a torch_dist checkpoint (MambaMixer.sharded_state_dict) the parts
are keys of their own: `in_proj.weight.{z,x,B,C,dt}`, `conv1d.{weight,bias}.{x,B,C}`; every layer is
under its own `decoder.layers.{i}.` with no layer dim (MambaStack.sharded_state_dict).

megajax stacks a hybrid's repeating group of layers (model.hybrid_group()): model layer n is
`layers/layer{n % g}/...` at index n // g of the stack; `layer_rows` pairs a Megatron layer with
the rows of its slot.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from megajax.checkpoint.mapping import Row, depthwise, flat, linear, rows_for
from megajax.config import ModelConfig
from megajax.models.layout import EXPERT_BIAS

_L = "decoder.layers.{i}"
MAMBA_SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
IN_PROJ_PARTS = ("z", "x", "B", "C", "dt")  # MambaMixer.sharded_state_dict's names, in in_proj's order
CONV_PARTS = ("x", "B", "C")
# Megatron's fixed Mamba mixer sizes (MambaMixer's defaults; Megatron-LM has no flag for them).
MEGATRON_CONV_KERNEL = 4
MEGATRON_CHUNK_SIZE = 128
MEGATRON_MIXER_NORM_EPS = 1e-5  # the gated RMSNorm's (ExtendedRMSNorm(eps=1e-5))

# Per layer kind: the name of its pre-norm (without weight / bias) and the modules with an _extra_state.
_NORM = {"M": f"{_L}.mixer.in_proj.layer_norm_", "*": f"{_L}.self_attention.linear_qkv.layer_norm_",
         "-": f"{_L}.mlp.linear_fc1.layer_norm_", "E": f"{_L}.pre_mlp_layernorm."}
_EXTRA_STATE = {"M": ("mixer.in_proj", "mixer.out_proj"),
                "*": ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj"),
                "-": ("mlp.linear_fc1", "mlp.linear_fc2")}


def _mamba_rows(x: str) -> tuple[Row, ...]:
    """A Mamba mixer's rows, its parameters under `x` (`layers/layer{j}/mixer/`)."""
    return (
        Row(f"{_L}.mixer.in_proj.weight", *(linear(f"{x}{p}/kernel") for p in IN_PROJ_PARTS),
            groups="tensor", split="column"),
        Row(f"{_L}.mixer.conv1d.weight", *(depthwise(f"{x}conv_{p}", n_in=2) for p in CONV_PARTS),
            groups="tensor", split="column"),
        Row(f"{_L}.mixer.conv1d.bias", *(flat(f"{x}conv_{p}_bias") for p in CONV_PARTS), groups="tensor",
            split="column"),
        *(Row(f"{_L}.mixer.{p}", flat(f"{x}{p}"), split="column") for p in ("A_log", "D", "dt_bias")),
        Row(f"{_L}.mixer.norm.weight", flat(f"{x}norm"), split="column"),
        Row(f"{_L}.mixer.out_proj.weight", linear(f"{x}out/kernel", n_in=2), split="row"),
    )


def _moved(row: Row, old: str, new: str) -> Row:
    """A GPT decoder row with its parameters moved from under `old` to under `new` (no aliases: the
    hybrid spec names each tensor one way)."""
    options = {f.name: getattr(row, f.name) for f in dataclasses.fields(Row)
               if f.name not in ("name", "parts", "aliases")}
    return Row(row.name, *(dataclasses.replace(p, path=new + p.path[len(old):]) for p in row.parts), **options)


def _slot_rows(kind: str, slot: str, decoder_rows: tuple[Row, ...]) -> tuple[Row, ...]:
    """The rows of a layer of `kind` whose parameters are under `slot` (`layers/layer{j}/`): its pre-norm,
    then its mixer's (attention, MLP and experts as `decoder_rows`, the GPT table, names them)."""
    norm = tuple(Row(_NORM[kind] + w, flat(f"{slot}norm/{p}")) for w, p in (("weight", "scale"), ("bias", "bias")))
    if kind == "M":
        return norm + _mamba_rows(slot + "mixer/")
    old = "layers/attn/" if kind == "*" else "layers/mlp/"
    return norm + tuple(_moved(r, old, slot + "mixer/") for r in decoder_rows
                        if r.per_layer and all(p.path.startswith(old) and p.path != EXPERT_BIAS for p in r.parts)
                        and not r.name.endswith(".linear_q_proj.weight"))  # q is in linear_qkv


def hybrid_rows(shapes: dict, m: ModelConfig, decoder_rows: tuple[Row, ...]) -> list[Row]:
    """The rows of a hybrid model of layout `shapes`: embeddings, each slot of the repeating group's
    layers, the final norm and the output layer; CheckpointError for a parameter no row holds."""
    top = tuple(r for r in decoder_rows if not r.per_layer and not r.name.startswith("decoder.final_layernorm"))
    top += tuple(Row(f"decoder.final_norm.{w}", flat(f"final_norm/{p}")) for w, p in (("weight", "scale"),
                                                                                      ("bias", "bias")))
    slots = [f"layers/layer{j}/" for j in range(len(m.hybrid_group()))]
    rows = rows_for(top, {k: v for k, v in shapes.items() if not k.startswith("layers/")}, "Megatron-Core")
    first = next(k for k, r in enumerate(rows) if not r.name.startswith("embedding."))
    layers = [r for j, kind in enumerate(m.hybrid_group())
              for r in rows_for(_slot_rows(kind, slots[j], decoder_rows),
                                {k: v for k, v in shapes.items() if k.startswith(slots[j])}, "Megatron-Core")]
    if EXPERT_BIAS in shapes:  # the MoE layers' router expert bias: one row of `layers/` per MoE layer
        layers += [r for r in decoder_rows if r.per_layer and r.parts[0].path == EXPERT_BIAS]
    return rows[:first] + layers + rows[first:]


def layer_rows(rows: list[Row], m: ModelConfig, layer: int) -> Iterator[tuple[Row, int]]:
    """(row, index in the stack) for the rows of model layer `layer`: its slot's in the repeating group."""
    g, pattern = len(m.hybrid_group()), m.hybrid_pattern()
    slot = f"layers/layer{layer % g}/"
    yield from ((r, layer // g) for r in rows if r.per_layer and r.parts[0].path.startswith(slot))
    if pattern[layer] == "E":  # its router's expert bias, at its index among the MoE layers
        yield from ((r, pattern[:layer].count("E")) for r in rows if r.per_layer and r.parts[0].path == EXPERT_BIAS)


def extra_state(m: ModelConfig, layer: int, local: int, moe_keys) -> list[str]:
    """The `_extra_state` keys (Transformer Engine's modules') of model layer `layer`, numbered `local`
    on its stage; `moe_keys(local)`: a mixture of experts layer's (its experts' linears)."""
    kind = m.hybrid_pattern()[layer]
    if kind == "E":
        return moe_keys(local)
    return [f"{_L}.{x}._extra_state".replace("{i}", str(local)) for x in _EXTRA_STATE[kind]]


def check_exportable(m: ModelConfig, tp: int) -> list[str]:
    """What Megatron-Core's hybrid model cannot hold of `m` at tensor parallel size `tp`."""
    problems = []
    if "M" in m.hybrid_pattern():
        for name, value in (("mamba_num_heads", m.mamba_num_heads), ("mamba_num_groups", m.mamba_num_groups)):
            if value % tp:  # MambaMixer asserts both: each rank holds whole heads and whole groups
                problems.append(f"model.{name}={value} is not divisible by tensor_parallel={tp}")
        if m.mamba_conv_kernel != MEGATRON_CONV_KERNEL:
            problems.append(f"model.mamba_conv_kernel={m.mamba_conv_kernel}: Megatron-Core's Mamba mixer's conv is "
                            f"{MEGATRON_CONV_KERNEL} wide (Megatron-LM has no flag for it)")
    if m.qk_norm:
        problems.append("model.qk_norm=true: the hybrid model's attention layers have no q/k norms")
    return problems


def hybrid_args(m: ModelConfig) -> dict:
    """The args Megatron-LM's pretrain_mamba.py saves for a hybrid model (both pattern args: megatron-core
    0.16 reads hybrid_override_pattern, without stage boundaries; newer ones hybrid_layer_pattern)."""
    return dict(is_hybrid_model=True, hybrid_override_pattern=m.hybrid_pattern(),
                hybrid_layer_pattern=m.hybrid_layer_pattern, hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0,
                mamba_state_dim=m.mamba_state_dim, mamba_head_dim=m.mamba_head_dim,
                mamba_num_groups=m.mamba_num_groups, mamba_num_heads=m.mamba_num_heads, spec=MAMBA_SPEC)


def hybrid_overrides(args, get, reject) -> dict:
    """ModelConfig fields of a hybrid model from Megatron `args` ({} when it is no hybrid); `get(name,
    default)` reads an arg, `reject(name, value, accepted)` raises."""
    pattern = get("hybrid_layer_pattern") or get("hybrid_override_pattern")
    if not pattern:
        if get("is_hybrid_model", False) or get("hybrid_attention_ratio", 0.0) or get("hybrid_mlp_ratio", 0.0):
            reject("hybrid_override_pattern", None, "the layer pattern (megajax does not allocate layers from "
                   "hybrid_attention_ratio / hybrid_mlp_ratio)")
        return {}
    if "/" in pattern:
        reject("hybrid_layer_pattern", pattern, "a pattern without multi-token prediction layers ('/')")
    out = dict(hybrid_layer_pattern=str(pattern), num_layers=len(str(pattern).replace("|", "")), moe_layer_freq=1)
    if "M" in pattern:
        heads = get("mamba_num_heads")
        out.update(mamba_state_dim=int(get("mamba_state_dim", 128)), mamba_head_dim=int(get("mamba_head_dim", 64)),
                   mamba_num_groups=int(get("mamba_num_groups", 8)), mamba_num_heads=None if heads is None else int(heads),
                   mamba_conv_kernel=MEGATRON_CONV_KERNEL, mamba_chunk_size=MEGATRON_CHUNK_SIZE)
    return out


def _part_sizes(m: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """{fused tensor (within a layer): its torch_dist parts (name, rows) in order}."""
    inner, gn, h = m.mamba_inner_size(), m.mamba_num_groups * m.mamba_state_dim, m.mamba_num_heads
    conv = tuple(zip(CONV_PARTS, (inner, gn, gn)))
    return {"mixer.in_proj.weight": tuple(zip(IN_PROJ_PARTS, (inner, inner, gn, gn, h))),
            "mixer.conv1d.weight": conv, "mixer.conv1d.bias": conv}


def split_parts(rest: str, x, m: ModelConfig) -> dict | None:
    """torch_dist's part keys {`rest.z`: [d_in, D], ...} of a TP-1 fused Mamba tensor `rest` (a key within
    its layer, e.g. `mixer.in_proj.weight`), or None for any other tensor."""
    parts = _part_sizes(m).get(rest) if m.hybrid_layer_pattern else None
    if parts is None:
        return None
    pieces = x.split([n for _, n in parts])
    return {f"{rest}.{name}": piece.clone() for (name, _), piece in zip(parts, pieces)}


def joined_parts(names) -> dict[str, tuple[str, ...]]:
    """{fused TP-1 name: its torch_dist part keys, in order} for the Mamba part keys among `names`."""
    names = set(names)
    out = {}
    for rest, parts in (("mixer.in_proj.weight", IN_PROJ_PARTS), ("mixer.conv1d.weight", CONV_PARTS),
                        ("mixer.conv1d.bias", CONV_PARTS)):
        for name in names:
            if name.endswith(f".{rest}.{parts[0]}"):
                fused = name[:-len(parts[0]) - 1]
                out[fused] = tuple(f"{fused}.{p}" for p in parts)
    return out
