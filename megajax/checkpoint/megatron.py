"""Megatron-Core legacy (`torch` format) checkpoints: export and import.

    <dir>/latest_checkpointed_iteration.txt            the iteration, or `release`
    <dir>/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
         (or <dir>/release/... when no iteration is given)

Each `.pt` file is a torch.save'd dict {model, checkpoint_version 3.0, iteration,
args} where `model` is the state dict of Megatron-Core's GPTModel with the local
(non Transformer Engine) layer spec for that tensor/pipeline rank, and `args`
an argparse.Namespace with the hyper-parameters Megatron reads back.

Layouts (PyTorch linear weights are [out, in]):
- `linear_qkv` rows are grouped per query group g: [q of g's heads | k of g | v of g];
  its tensor-parallel shards are contiguous blocks of groups.
- Column-parallel (split on dim 0): word embeddings, output layer, linear_qkv,
  linear_fc1; row-parallel (dim 1): linear_proj, linear_fc2. Norms and
  row-parallel biases are replicated. The vocabulary is padded to a multiple of
  make_vocab_size_divisible_by x TP.
- SwiGLU's linear_fc1 is, on each TP rank, [gate shard; up shard].
- Pipeline stages hold consecutive layers numbered from 0 within the stage; the
  first stage holds the embeddings, the last the final norm and output layer
  (with tied embeddings and PP > 1, a copy of the word embeddings as
  `output_layer.weight`, as Megatron keeps one there).

Memory: torch.save needs a rank file's whole state dict, so the export builds
one rank file at a time, reading the source one layer tensor at a time and
keeping only that rank's shard: peak host memory is about one rank file
(model / (TP x PP) in the output dtype) plus one full layer tensor. The price
is that each source tensor is read TP times.
"""

from __future__ import annotations

import argparse
import pickle
import re
import warnings
import zipfile
from pathlib import Path

import numpy as np

from megajax.checkpoint.common import (atomic_output_dir, check_source, model_overrides, padded_zeros,
                                       param_shapes, resolved_model)
from megajax.checkpoint.source import unflatten
from megajax.config import ModelConfig
from megajax.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?$")


def _torch():
    try:
        import torch
    except ImportError:
        raise CheckpointError("Megatron checkpoints need PyTorch: pip install 'megajax[torch]'.") from None
    return torch


def rank_dir(tp_rank: int, pp_rank: int, pipeline_parallel: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pipeline_parallel == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


# ----------------------------------------------------------------------------
# Layouts: megajax layer tensors <-> Megatron's global [out, in] weights
# ----------------------------------------------------------------------------

def _qkv_groups(q, k, v, groups: int) -> np.ndarray:
    """q [D, H, hd], k/v [D, G, hd] -> [G, (H/G + 2) * hd, D]: each group's q rows, then its k, then its v.
    Also serves biases: q [H, hd], k/v [G, hd] -> [G, (H/G + 2) * hd]."""
    if q.ndim == 3:
        d = q.shape[0]
        q, k, v = (x.reshape(d, -1).T for x in (q, k, v))  # [heads * hd, D]
    else:
        q, k, v = (x.reshape(-1) for x in (q, k, v))
    rest = q.shape[1:]
    return np.concatenate([x.reshape((groups, -1) + rest) for x in (q, k, v)], axis=1)


def _qkv_ungroup(w: np.ndarray, m: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of _qkv_groups on the merged linear_qkv weight [G * (r + 2) * hd, D] (or bias)."""
    g, hd = m.num_kv_heads, m.head_dim
    r = m.num_heads // g
    rest = w.shape[1:]
    w = w.reshape((g, (r + 2) * hd) + rest)
    q, k, v = w[:, :r * hd], w[:, r * hd:(r + 1) * hd], w[:, (r + 1) * hd:]
    if rest:  # weights: [G, n * hd, D] -> [D, heads, hd]
        d = rest[0]
        return (q.reshape(-1, d).T.reshape(d, m.num_heads, hd), k.reshape(-1, d).T.reshape(d, g, hd),
                v.reshape(-1, d).T.reshape(d, g, hd))
    return q.reshape(m.num_heads, hd), k.reshape(g, hd), v.reshape(g, hd)


def _rows(x: np.ndarray, rank: int, size: int) -> np.ndarray:
    n = x.shape[0] // size
    return x[rank * n:(rank + 1) * n]


def _vocab_shard(x_VxD: np.ndarray, padded: int, rank: int, size: int) -> np.ndarray:
    """Rows [rank * n, (rank + 1) * n) of x padded with zero rows to `padded` (n = padded / size),
    without materialising the whole padded table."""
    n = padded // size
    lo, hi = rank * n, min((rank + 1) * n, x_VxD.shape[0])
    out = np.zeros((n,) + x_VxD.shape[1:], np.float32)
    if hi > lo:
        out[:hi - lo] = x_VxD[lo:hi]
    return out


def _cols(x: np.ndarray, rank: int, size: int) -> np.ndarray:
    n = x.shape[1] // size
    return x[:, rank * n:(rank + 1) * n]


# ----------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------

def _check_exportable(m: ModelConfig, tp: int, pp: int) -> None:
    problems = []
    for name, value in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads),
                        ("ffn_hidden_size", m.ffn_hidden_size)):
        if value % tp:
            problems.append(f"model.{name}={value} is not divisible by tensor_parallel={tp}")
    if m.num_layers % pp:
        problems.append(f"model.num_layers={m.num_layers} is not divisible by pipeline_parallel={pp}")
    if m.position_embedding == "rope" and m.rope_scaling == "llama3" and (
            m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_position) != (1.0, 4.0, 8192):
        problems.append(f"llama3 rope scaling with rope_low_freq_factor={m.rope_low_freq_factor}, "
                        f"rope_high_freq_factor={m.rope_high_freq_factor}, rope_original_max_position="
                        f"{m.rope_original_max_position}: Megatron-Core fixes them at 1, 4 and 8192")
    if problems:
        raise CheckpointError(f"cannot export to a Megatron checkpoint: {'; '.join(problems)}.")


def megatron_args(m: ModelConfig, *, tensor_parallel: int, pipeline_parallel: int, padded_vocab_size: int,
                  dtype: str, iteration: int) -> argparse.Namespace:
    """The `args` Namespace Megatron-LM saves with a checkpoint (the fields its loader and converters read)."""
    torch = _torch()
    rope = m.position_embedding == "rope"
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_heads, num_query_groups=m.num_kv_heads,
        group_query_attention=m.num_kv_heads != m.num_heads, kv_channels=m.head_dim,
        max_position_embeddings=m.max_position_embeddings, seq_length=m.max_position_embeddings,
        vocab_size=m.vocab_size, padded_vocab_size=padded_vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        normalization={"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[m.norm], norm_epsilon=m.norm_eps,
        apply_layernorm_1p=False, swiglu=m.activation == "swiglu", openai_gelu=False, squared_relu=False,
        position_embedding_type="rope" if rope else "learned_absolute",
        add_position_embedding=not rope, use_rotary_position_embeddings=rope,
        rotary_base=int(m.rope_theta) if float(m.rope_theta).is_integer() else m.rope_theta,
        rotary_percent=1.0, rotary_interleaved=False,
        use_rope_scaling=rope and m.rope_scaling == "llama3", rope_scaling_factor=m.rope_scaling_factor,
        untie_embeddings_and_output_weights=not m.tie_embeddings,
        add_bias_linear=m.use_bias, add_qkv_bias=m.use_bias, qk_layernorm=False,
        apply_residual_connection_post_layernorm=False, num_experts=None,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout, init_method_std=m.init_std,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        sequence_parallel=False, transformer_impl="local", use_legacy_models=False, ckpt_format="torch",
        bf16=dtype == "bf16", fp16=False, params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
        iteration=iteration, consumed_train_samples=0, consumed_valid_samples=0,
    )


def _rank_state_dict(source, m: ModelConfig, tp: int, pp: int, t: int, s: int, padded: int, dtype) -> dict:
    """The state dict of tensor rank t, pipeline stage s, reading the source one layer tensor at a time."""
    torch = _torch()
    use_bias, swiglu, g = m.use_bias, m.activation == "swiglu", m.num_kv_heads
    per_stage = m.num_layers // pp
    first, last = s == 0, s == pp - 1
    sd: dict = {}

    def put(key, x):  # a fresh tensor: never a view holding the whole source tensor
        sd[key] = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(dtype=dtype, copy=True)

    def vocab_rows():  # [Vp / TP, D] shard of the word embeddings, padded for this TP
        return _vocab_shard(source.get("embed/embedding")[:m.vocab_size], padded, t, tp)

    if first:
        put("embedding.word_embeddings.weight", vocab_rows())
        if m.position_embedding == "learned":
            put("embedding.position_embeddings.weight", source.get("pos_embed"))
    for local in range(per_stage):
        i = s * per_stage + local
        p = f"decoder.layers.{local}"

        def get(name, i=i):
            return source.get(name, layer=i)

        for norm, ours in (("input_layernorm", "attn_norm"), ("pre_mlp_layernorm", "mlp_norm")):
            put(f"{p}.{norm}.weight", get(f"layers/{ours}/scale"))
            if m.norm == "layernorm":
                put(f"{p}.{norm}.bias", get(f"layers/{ours}/bias"))
        a = "layers/attn"
        qkv = _qkv_groups(get(f"{a}/q/kernel"), get(f"{a}/k/kernel"), get(f"{a}/v/kernel"), g)
        put(f"{p}.self_attention.linear_qkv.weight", _rows(qkv, t, tp).reshape(-1, m.hidden_size))
        del qkv
        if use_bias:
            qkv_bias = _qkv_groups(get(f"{a}/q/bias"), get(f"{a}/k/bias"), get(f"{a}/v/bias"), g)
            put(f"{p}.self_attention.linear_qkv.bias", _rows(qkv_bias, t, tp).reshape(-1))
        sd[f"{p}.self_attention.linear_qkv._extra_state"] = None
        o = get(f"{a}/o/kernel")
        put(f"{p}.self_attention.linear_proj.weight", _cols(o.reshape(-1, m.hidden_size).T, t, tp))
        del o
        if use_bias:
            put(f"{p}.self_attention.linear_proj.bias", get(f"{a}/o/bias"))
        sd[f"{p}.self_attention.linear_proj._extra_state"] = None
        fc1 = ("gate", "up") if swiglu else ("fc1",)
        put(f"{p}.mlp.linear_fc1.weight",
            np.concatenate([_rows(get(f"layers/mlp/{c}/kernel").T, t, tp) for c in fc1]))
        if use_bias:
            put(f"{p}.mlp.linear_fc1.bias", np.concatenate([_rows(get(f"layers/mlp/{c}/bias"), t, tp) for c in fc1]))
        sd[f"{p}.mlp.linear_fc1._extra_state"] = None
        put(f"{p}.mlp.linear_fc2.weight", _cols(get("layers/mlp/fc2/kernel").T, t, tp))
        if use_bias:
            put(f"{p}.mlp.linear_fc2.bias", get("layers/mlp/fc2/bias"))
        sd[f"{p}.mlp.linear_fc2._extra_state"] = None
    if last:
        put("decoder.final_layernorm.weight", source.get("final_norm/scale"))
        if m.norm == "layernorm":
            put("decoder.final_layernorm.bias", source.get("final_norm/bias"))
        if not m.tie_embeddings:
            put("output_layer.weight", _vocab_shard(source.get("output")[:, :m.vocab_size].T, padded, t, tp))
        elif not first:  # tied, PP > 1: the last stage keeps its own copy of the word embeddings
            put("output_layer.weight", vocab_rows())
        sd["output_layer._extra_state"] = None
    return sd


def export_megatron(source, out_dir, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    dtype: str = "bf16", iteration: int | None = None) -> Path:
    """Writes `source` (a TensorSource) as a Megatron-Core legacy checkpoint directory `out_dir`.

    `iteration` None writes a `release` checkpoint (what Megatron loads for
    fine-tuning), else `iter_{iteration:07d}` (iteration >= 1; Megatron's
    loader rejects 0). `dtype` is 'bf16' or 'fp32'. Returns the directory.
    """
    torch = _torch()
    m = source.model
    if dtype not in ("bf16", "fp32"):
        raise CheckpointError(f"export dtype={dtype!r} is not supported; accepted: bf16, fp32.")
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise CheckpointError(f"tensor_parallel={tensor_parallel} and pipeline_parallel={pipeline_parallel} "
                              f"must be >= 1.")
    if iteration is not None and iteration < 1:
        raise CheckpointError(f"iteration={iteration}: Megatron's loader needs an iteration >= 1 "
                              f"(or none, for a release checkpoint).")
    _check_exportable(m, tensor_parallel, pipeline_parallel)
    check_source(source)
    padded = m.megatron_padded_vocab_size(tensor_parallel)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    args = megatron_args(m, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                         padded_vocab_size=padded, dtype=dtype, iteration=iteration or 0)
    step_dir = "release" if iteration is None else f"iter_{iteration:07d}"
    with atomic_output_dir(out_dir) as tmp:
        for s in range(pipeline_parallel):
            for t in range(tensor_parallel):
                sd = _rank_state_dict(source, m, tensor_parallel, pipeline_parallel, t, s, padded, torch_dtype)
                path = tmp / step_dir / rank_dir(t, s, pipeline_parallel) / CHECKPOINT_FILE
                path.parent.mkdir(parents=True)
                torch.save({"model": sd, "checkpoint_version": CHECKPOINT_VERSION,
                            "iteration": iteration or 0, "args": args}, path)
                del sd
        (tmp / TRACKER).write_text("release" if iteration is None else str(iteration))
    return Path(out_dir)


# ----------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------

def _step_dir(d: Path) -> Path:
    """The directory holding the mp_rank_* folders: d itself, or the one its tracker file names."""
    if any(_RANK_DIR.match(p.name) for p in d.iterdir() if p.is_dir()):
        return d
    tracker = d / TRACKER
    if not tracker.is_file():
        if (d / "metadata.json").is_file() or any(d.glob("*.distcp")):
            raise CheckpointError(f"{str(d)!r} is a Megatron distributed (torch_dist) checkpoint; megajax reads "
                                  f"the legacy torch format (save with --ckpt-format torch, or convert).")
        raise CheckpointError(f"{str(d)!r} is not a Megatron checkpoint: no {TRACKER} and no mp_rank_* folders.")
    text = tracker.read_text().strip()
    if text == "release":
        step = d / "release"
    elif text.isdigit():
        step = d / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"{str(tracker)!r} holds {text!r}; expected an iteration number or 'release'.")
    if not step.is_dir():
        raise CheckpointError(f"{str(tracker)!r} names {step.name}, but {str(step)!r} does not exist.")
    if (step / "metadata.json").is_file() or any(step.glob("*.distcp")):
        raise CheckpointError(f"{str(step)!r} is a Megatron distributed (torch_dist) checkpoint; megajax reads "
                              f"the legacy torch format (save with --ckpt-format torch, or convert).")
    return step


def _safe_globals(with_megatron: bool) -> list:
    """Classes a Megatron checkpoint may pickle besides tensors: its args Namespace, numpy RNG states
    and (when megatron-core is installed) the enums and configs megatron-core itself allows."""
    import numpy.core.multiarray as multiarray
    out = [argparse.Namespace, np.ndarray, np.dtype, multiarray._reconstruct, type(np.dtype(np.uint32))]
    if with_megatron:
        try:
            with warnings.catch_warnings():  # megatron-core warns at import about optional back ends
                warnings.simplefilter("ignore")
                from megatron.core.safe_globals import SAFE_GLOBALS
            out += list(SAFE_GLOBALS)
        except Exception:  # noqa: BLE001 - optional; without it fewer classes are allowed
            pass
    return out


def _load(path: Path, allow_pickle: bool) -> dict:
    """torch.load of a rank file (memory-mapped when it is a zip archive), weights-only unless allowed."""
    torch = _torch()
    kwargs = dict(map_location="cpu", mmap=zipfile.is_zipfile(path))
    try:
        if allow_pickle:
            return torch.load(path, weights_only=False, **kwargs)
        error = None
        for with_megatron in (False, True):  # megatron-core's list only when needed: importing it is slow
            try:
                with torch.serialization.safe_globals(_safe_globals(with_megatron)):
                    return torch.load(path, weights_only=True, **kwargs)
            except pickle.UnpicklingError as e:
                error = e
        raise error
    except pickle.UnpicklingError as e:
        blocked = re.search(r"GLOBAL ([\w.]+)", str(e))
        if blocked is None:
            detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
            raise CheckpointError(f"{str(path)!r} is not a readable torch checkpoint file"
                                  f"{f' ({detail.group(1).strip()})' if detail else ''}.") from None
        raise CheckpointError(f"Megatron checkpoint file {str(path)!r} holds a Python object the weights-only "
                              f"loader does not allow ({blocked.group(1)}); if you trust the file, import it "
                              f"with allow_pickle=True.") from None
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointError(f"cannot read Megatron checkpoint file {str(path)!r}: "
                              f"{str(e).strip().splitlines()[0]}") from None


def _arg(args, name: str, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def _overrides_from_args(args) -> dict:
    """ModelConfig fields from a Megatron `args`; CheckpointError for what megajax cannot represent."""
    def reject(name, value, accepted):
        raise CheckpointError(f"Megatron args {name}={value!r} cannot be represented in megajax; accepted: {accepted}.")

    for name in ("apply_layernorm_1p", "openai_gelu", "squared_relu", "qk_layernorm", "rotary_interleaved",
                 "apply_residual_connection_post_layernorm", "multi_latent_attention"):
        if _arg(args, name, False):
            reject(name, getattr(args, name), "False")
    if _arg(args, "num_experts"):
        reject("num_experts", args.num_experts, "None (mixture-of-experts is not supported yet)")
    if _arg(args, "virtual_pipeline_model_parallel_size"):
        reject("virtual_pipeline_model_parallel_size", args.virtual_pipeline_model_parallel_size, "None")
    if _arg(args, "rotary_percent", 1.0) != 1.0:
        reject("rotary_percent", args.rotary_percent, "1.0")
    position = _arg(args, "position_embedding_type")
    if position is None:
        position = "rope" if _arg(args, "use_rotary_position_embeddings", False) else "learned_absolute"
    if position not in ("rope", "learned_absolute"):
        reject("position_embedding_type", position, "rope, learned_absolute")
    normalization = _arg(args, "normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        reject("normalization", normalization, "LayerNorm, RMSNorm")
    bias = bool(_arg(args, "add_bias_linear", True))
    if _arg(args, "add_qkv_bias", False) and not bias:
        reject("add_qkv_bias", True, "add_qkv_bias only together with add_bias_linear (one model.use_bias)")
    hidden, heads = args.hidden_size, args.num_attention_heads
    groups = _arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention", False) else heads
    swiglu = bool(_arg(args, "swiglu", False))
    out = dict(family="llama" if position == "rope" else "gpt", num_layers=args.num_layers, hidden_size=hidden,
               num_heads=heads, num_kv_heads=groups, head_dim=_arg(args, "kv_channels", hidden // heads),
               ffn_hidden_size=_arg(args, "ffn_hidden_size", 4 * hidden),
               vocab_size=_arg(args, "vocab_size", _arg(args, "padded_vocab_size")),
               max_position_embeddings=_arg(args, "max_position_embeddings", _arg(args, "seq_length")),
               norm="rmsnorm" if normalization == "RMSNorm" else "layernorm",
               activation="swiglu" if swiglu else "gelu",
               position_embedding="rope" if position == "rope" else "learned", use_bias=bias,
               tie_embeddings=not _arg(args, "untie_embeddings_and_output_weights", False),
               norm_eps=float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))),
               rope_theta=float(_arg(args, "rotary_base", 10000)),
               hidden_dropout=float(_arg(args, "hidden_dropout", 0.0)),
               attention_dropout=float(_arg(args, "attention_dropout", 0.0)),
               init_std=float(_arg(args, "init_method_std", 0.02)))
    if position == "rope" and _arg(args, "use_rope_scaling", False):
        out.update(rope_scaling="llama3", rope_scaling_factor=float(_arg(args, "rope_scaling_factor", 8.0)),
                   rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192)
    if out["vocab_size"] is None or out["max_position_embeddings"] is None:
        raise CheckpointError("Megatron args give neither vocab_size nor padded_vocab_size, or no "
                              "max_position_embeddings / seq_length.")
    return out


class _Stage:
    """The TP shards of one pipeline stage's state dicts, consumed key by key."""

    def __init__(self, dicts: list[dict], where: str):
        self.dicts, self.where = dicts, where
        self.used: set[str] = set()

    def keys(self) -> set[str]:
        return {k for k in self.dicts[0] if not k.endswith("_extra_state")}

    def shards(self, key: str) -> list[np.ndarray]:
        if key not in self.dicts[0]:
            raise CheckpointError(f"Megatron checkpoint {self.where} has no {key}.")
        self.used.add(key)
        out = []
        for t, d in enumerate(self.dicts):
            if key not in d or d[key] is None:
                raise CheckpointError(f"Megatron checkpoint {self.where}: tensor rank {t} has no {key}.")
            out.append(d[key].float().numpy())
        return out

    def cat(self, key: str, axis: int, shape: tuple[int, ...]) -> np.ndarray:
        x = np.concatenate(self.shards(key), axis)
        return _expect(x, shape, key, self.where)

    def one(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        return _expect(self.shards(key)[0], shape, key, self.where)

    def first_of(self, *keys: str) -> str:
        """The first of several alternative key names present (local vs Transformer Engine spec)."""
        for k in keys:
            if k in self.dicts[0]:
                return k
        return keys[0]


def _expect(x: np.ndarray, shape: tuple[int, ...], key: str, where: str) -> np.ndarray:
    if x.shape != tuple(shape):
        raise CheckpointError(f"Megatron checkpoint {where}: {key} has shape {list(x.shape)} (tensor shards "
                              f"merged), but its args imply {list(shape)}.")
    return x


def _fill_stage(st: _Stage, m: ModelConfig, first: bool, last: bool, layers: list[int], offset: int,
                vocab_padded: int, padded: int, out: dict) -> None:
    d, f, hd = m.hidden_size, m.ffn_hidden_size, m.head_dim
    qkv_rows = (m.num_heads + 2 * m.num_kv_heads) * hd
    v = m.vocab_size
    if first:
        emb = st.cat("embedding.word_embeddings.weight", 0, (vocab_padded, d))
        out["embed/embedding"][:] = padded_zeros(emb[:v], padded, 0)
        if m.position_embedding == "learned":
            out["pos_embed"][:] = st.one("embedding.position_embeddings.weight", (m.max_position_embeddings, d))
    for local in layers:
        i, p = offset + local, f"decoder.layers.{local}"
        norms = (("attn_norm", (f"{p}.input_layernorm", f"{p}.self_attention.linear_qkv.layer_norm_")),
                 ("mlp_norm", (f"{p}.pre_mlp_layernorm", f"{p}.mlp.linear_fc1.layer_norm_")))
        for ours, (local_name, te_prefix) in norms:
            for param, suffix in (("scale", "weight"), ("bias", "bias")):
                if param == "bias" and m.norm != "layernorm":
                    continue
                key = st.first_of(f"{local_name}.{suffix}", f"{te_prefix}{suffix}")
                out[f"layers/{ours}/{param}"][i] = st.one(key, (d,))
        a = "layers/attn"
        q, k, vv = _qkv_ungroup(st.cat(f"{p}.self_attention.linear_qkv.weight", 0, (qkv_rows, d)), m)
        out[f"{a}/q/kernel"][i], out[f"{a}/k/kernel"][i], out[f"{a}/v/kernel"][i] = q, k, vv
        proj = st.cat(f"{p}.self_attention.linear_proj.weight", 1, (d, m.num_heads * hd))
        out[f"{a}/o/kernel"][i] = proj.T.reshape(m.num_heads, hd, d)
        fc1 = st.shards(f"{p}.mlp.linear_fc1.weight")
        if m.activation == "swiglu":  # each shard is [gate shard; up shard]
            gate = np.concatenate([x[:x.shape[0] // 2] for x in fc1])
            up = np.concatenate([x[x.shape[0] // 2:] for x in fc1])
            out["layers/mlp/gate/kernel"][i] = _expect(gate, (f, d), f"{p}.mlp.linear_fc1.weight (gate)", st.where).T
            out["layers/mlp/up/kernel"][i] = _expect(up, (f, d), f"{p}.mlp.linear_fc1.weight (up)", st.where).T
        else:
            out["layers/mlp/fc1/kernel"][i] = _expect(np.concatenate(fc1), (f, d), f"{p}.mlp.linear_fc1.weight",
                                                      st.where).T
        out["layers/mlp/fc2/kernel"][i] = st.cat(f"{p}.mlp.linear_fc2.weight", 1, (d, f)).T
        if m.use_bias:
            q, k, vv = _qkv_ungroup(st.cat(f"{p}.self_attention.linear_qkv.bias", 0, (qkv_rows,)), m)
            out[f"{a}/q/bias"][i], out[f"{a}/k/bias"][i], out[f"{a}/v/bias"][i] = q, k, vv
            out[f"{a}/o/bias"][i] = st.one(f"{p}.self_attention.linear_proj.bias", (d,))
            fc1_bias = st.shards(f"{p}.mlp.linear_fc1.bias")
            if m.activation == "swiglu":
                out["layers/mlp/gate/bias"][i] = np.concatenate([x[:x.shape[0] // 2] for x in fc1_bias])
                out["layers/mlp/up/bias"][i] = np.concatenate([x[x.shape[0] // 2:] for x in fc1_bias])
            else:
                out["layers/mlp/fc1/bias"][i] = _expect(np.concatenate(fc1_bias), (f,), f"{p}.mlp.linear_fc1.bias",
                                                        st.where)
            out["layers/mlp/fc2/bias"][i] = st.one(f"{p}.mlp.linear_fc2.bias", (d,))
    if last:
        key = st.first_of("decoder.final_layernorm.weight", "decoder.final_norm.weight")
        out["final_norm/scale"][:] = st.one(key, (d,))
        if m.norm == "layernorm":
            out["final_norm/bias"][:] = st.one(key[:-len("weight")] + "bias", (d,))
        if not m.tie_embeddings:
            w = st.cat("output_layer.weight", 0, (vocab_padded, d))
            out["output"][:] = padded_zeros(w[:v], padded, 0).T
        elif "output_layer.weight" in st.dicts[0]:
            st.used.add("output_layer.weight")  # the last stage's copy of the tied embeddings
    left = sorted(st.keys() - st.used)
    if left:
        raise CheckpointError(f"Megatron checkpoint {st.where} holds tensors megajax does not know: "
                              f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}.")


def import_megatron(in_dir, *, allow_pickle: bool = False) -> tuple[dict, dict]:
    """Reads a Megatron-Core legacy checkpoint (the tracker's iteration, or `release`), merging TP/PP shards.

    `in_dir` is the save directory (with latest_checkpointed_iteration.txt) or
    one iteration's directory. Returns (model overrides, params) like
    import_hf: the architecture from `args`, the vocabulary padded to a
    multiple of 128 (tensor size 1). Files are read with torch's weights-only
    unpickler; `allow_pickle=True` lifts that for checkpoints you trust.
    """
    d = Path(in_dir).expanduser()
    if not d.is_dir():
        raise CheckpointError(f"{str(d)!r} is not a directory (expected a Megatron checkpoint directory).")
    step = _step_dir(d)
    ranks: dict[tuple[int, int], Path] = {}
    for p in step.iterdir():
        match = _RANK_DIR.match(p.name)
        if p.is_dir() and match:
            if match.group(3):
                raise CheckpointError(f"{str(p)!r}: expert-parallel checkpoints are not supported.")
            ranks[(int(match.group(1)), int(match.group(2) or 0))] = p / CHECKPOINT_FILE
    first = _load(ranks[(0, 0)], allow_pickle) if (0, 0) in ranks else None
    if first is None or "args" not in first or "model" not in first:
        what = "no mp_rank_00 file" if first is None else f"no {'args' if 'args' not in first else 'model'} entry"
        raise CheckpointError(f"{str(step)!r} is not a Megatron checkpoint megajax can read ({what}; the "
                              f"architecture is read from the saved args).")
    args = first["args"]
    tp, pp = int(_arg(args, "tensor_model_parallel_size", 1)), int(_arg(args, "pipeline_model_parallel_size", 1))
    want = {(t, s) for t in range(tp) for s in range(pp)}
    if set(ranks) != want or not all(f.is_file() for f in ranks.values()):
        have = sorted(p.parent.name for p in ranks.values() if p.is_file())
        raise CheckpointError(f"{str(step)!r}: args say tensor_model_parallel_size={tp}, "
                              f"pipeline_model_parallel_size={pp}, but the rank files present are {have}.")
    overrides = _overrides_from_args(args)
    m = resolved_model(overrides)
    vocab_padded = int(_arg(args, "padded_vocab_size", m.vocab_size))
    padded = m.padded_vocab_size()
    flat = {name: np.zeros(shape, np.float32) for name, shape in param_shapes(m, padded).items()}
    offset = 0
    for s in range(pp):
        dicts = [first["model"] if (t, s) == (0, 0) else _load(ranks[(t, s)], allow_pickle)["model"]
                 for t in range(tp)]
        layers = sorted({int(k.split(".")[2]) for k in dicts[0] if k.startswith("decoder.layers.")})
        if layers != list(range(len(layers))):
            raise CheckpointError(f"Megatron checkpoint stage {s}: layer numbers {layers} are not 0..n-1.")
        if offset + len(layers) > m.num_layers:
            raise CheckpointError(f"Megatron checkpoint holds more layers than args num_layers={m.num_layers}.")
        where = f"{step.name}/{rank_dir(0, s, pp)}" + (f" (and {tp - 1} more tensor ranks)" if tp > 1 else "")
        _fill_stage(_Stage(dicts, where), m, s == 0, s == pp - 1, layers, offset, vocab_padded, padded, flat)
        offset += len(layers)
        del dicts
    if offset != m.num_layers:
        raise CheckpointError(f"Megatron checkpoint holds {offset} layers, but args num_layers={m.num_layers}.")
    return model_overrides(m), unflatten(dict(sorted(flat.items())))
