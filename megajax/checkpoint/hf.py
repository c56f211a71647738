"""Hugging Face `transformers` directories: export (streaming) and import.

    export_hf(source, out_dir, tokenizer_spec=...)  ->  config.json, generation_config.json,
        model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json),
        tokenizer.json, tokenizer_config.json, special_tokens_map.json
    import_hf(in_dir)  ->  (model overrides, parameter tree of float32 numpy arrays)

The llama family maps to `LlamaForCausalLM`, the gpt family to `GPT2LMHeadModel`.
Hugging Face linear weights are [out, in]; GPT-2's Conv1D weights are [in, out]
and its q/k/v are one fused `c_attn` ([D, 3 x D], columns q | k | v, head-major).

The export reads one tensor (one layer of a stacked tensor) at a time from a
TensorSource, converts it and appends it to the current safetensors shard, so
peak host memory stays near the largest single tensor. It writes into a
temporary directory renamed at the end.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from megajax.checkpoint.common import (atomic_output_dir, check_source, model_overrides, numpy_dtype,
                                       padded_zeros, param_shapes, resolved_model)
from megajax.checkpoint.safetensors_io import ShardWriter, read_header, read_tensor
from megajax.checkpoint.source import unflatten
from megajax.config import ModelConfig
from megajax.errors import CheckpointError

LLAMA, GPT2 = "LlamaForCausalLM", "GPT2LMHeadModel"
EOD_TOKEN = "<|endoftext|>"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's default shard size (5 GB)
TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}

# (Hugging Face name, shape, producer of the float32 array in that layout)
Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


# ----------------------------------------------------------------------------
# Which Hugging Face architecture a model is, and what it cannot express
# ----------------------------------------------------------------------------

# Traits each architecture fixes (Llama's biases and tying are config options).
_ARCH_TRAITS = {
    LLAMA: dict(norm="rmsnorm", activation="swiglu", position_embedding="rope"),
    GPT2: dict(norm="layernorm", activation="gelu", position_embedding="learned", use_bias=True,
               tie_embeddings=True),
}


def architecture(m: ModelConfig) -> str:
    """The Hugging Face class a model exports to; CheckpointError naming every trait it cannot express."""
    arch = {"llama": LLAMA, "gpt": GPT2}[m.family]
    wrong = [f"{k}={getattr(m, k)} (needs {v})" for k, v in _ARCH_TRAITS[arch].items() if getattr(m, k) != v]
    if arch == GPT2:
        if m.num_kv_heads != m.num_heads:
            wrong.append(f"num_kv_heads={m.num_kv_heads} (needs num_kv_heads = num_heads = {m.num_heads}; "
                         f"GPT-2 has no grouped-query attention)")
        if m.head_dim * m.num_heads != m.hidden_size:
            wrong.append(f"head_dim={m.head_dim} (needs hidden_size / num_heads = "
                         f"{m.hidden_size // m.num_heads})")
    if wrong:
        raise CheckpointError(f"model.family={m.family} exports to Hugging Face {arch}, which cannot express "
                              f"{'; '.join(wrong)}. Export this model with --format megatron instead, or "
                              f"train it with the family's traits.")
    return arch


# ----------------------------------------------------------------------------
# Tensors in Hugging Face layout, produced one at a time
# ----------------------------------------------------------------------------

def _layer(source, name: str, i: int) -> np.ndarray:
    return source.get(name, layer=i)


def _llama_entries(source, m: ModelConfig) -> list[Entry]:
    d, h, kv, hd, f, v = (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_hidden_size,
                          m.vocab_size)
    get = functools.partial(_layer, source)

    def linear(name, i, out_dims):  # kernel [in..., out...] -> weight [out, in]
        def produce():
            x = get(name, i)
            return x.reshape(-1, int(np.prod(x.shape[-out_dims:]))).T
        return produce

    def in_major(name, i, in_dims):  # kernel [in..., out] -> weight [out, in...flattened]
        def produce():
            x = get(name, i)
            return x.reshape(int(np.prod(x.shape[:in_dims])), -1).T
        return produce

    def flat(name, i):
        return lambda: get(name, i).reshape(-1)

    out: list[Entry] = [("model.embed_tokens.weight", (v, d), lambda: source.get("embed/embedding")[:v])]
    for i in range(m.num_layers):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm.weight", (d,), flat("layers/attn_norm/scale", i)))
        for proj, heads in (("q", h), ("k", kv), ("v", kv)):
            out.append((f"{p}.self_attn.{proj}_proj.weight", (heads * hd, d),
                        linear(f"layers/attn/{proj}/kernel", i, 2)))
            if m.use_bias:
                out.append((f"{p}.self_attn.{proj}_proj.bias", (heads * hd,), flat(f"layers/attn/{proj}/bias", i)))
        out.append((f"{p}.self_attn.o_proj.weight", (d, h * hd), in_major("layers/attn/o/kernel", i, 2)))
        if m.use_bias:
            out.append((f"{p}.self_attn.o_proj.bias", (d,), flat("layers/attn/o/bias", i)))
        out.append((f"{p}.post_attention_layernorm.weight", (d,), flat("layers/mlp_norm/scale", i)))
        for hf, ours, shape in (("gate_proj", "gate", (f, d)), ("up_proj", "up", (f, d)),
                                ("down_proj", "fc2", (d, f))):
            out.append((f"{p}.mlp.{hf}.weight", shape, linear(f"layers/mlp/{ours}/kernel", i, 1)))
            if m.use_bias:
                out.append((f"{p}.mlp.{hf}.bias", shape[:1], flat(f"layers/mlp/{ours}/bias", i)))
    out.append(("model.norm.weight", (d,), lambda: source.get("final_norm/scale")))
    if not m.tie_embeddings:
        out.append(("lm_head.weight", (v, d), lambda: source.get("output")[:, :v].T))
    return out


def _gpt2_entries(source, m: ModelConfig) -> list[Entry]:
    d, f, v = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    get = functools.partial(_layer, source)

    def c_attn_weight(i):  # Conv1D [D, 3D]: columns q | k | v, each head-major
        return lambda: np.concatenate([get(f"layers/attn/{x}/kernel", i).reshape(d, -1) for x in "qkv"], 1)

    def c_attn_bias(i):
        return lambda: np.concatenate([get(f"layers/attn/{x}/bias", i).reshape(-1) for x in "qkv"])

    def as_is(name, i, shape):
        return lambda: get(name, i).reshape(shape)

    out: list[Entry] = [("transformer.wte.weight", (v, d), lambda: source.get("embed/embedding")[:v]),
                        ("transformer.wpe.weight", (m.max_position_embeddings, d),
                         lambda: source.get("pos_embed"))]
    for i in range(m.num_layers):
        p = f"transformer.h.{i}"
        out += [
            (f"{p}.ln_1.weight", (d,), as_is("layers/attn_norm/scale", i, (d,))),
            (f"{p}.ln_1.bias", (d,), as_is("layers/attn_norm/bias", i, (d,))),
            (f"{p}.attn.c_attn.weight", (d, 3 * d), c_attn_weight(i)),
            (f"{p}.attn.c_attn.bias", (3 * d,), c_attn_bias(i)),
            (f"{p}.attn.c_proj.weight", (d, d), as_is("layers/attn/o/kernel", i, (d, d))),
            (f"{p}.attn.c_proj.bias", (d,), as_is("layers/attn/o/bias", i, (d,))),
            (f"{p}.ln_2.weight", (d,), as_is("layers/mlp_norm/scale", i, (d,))),
            (f"{p}.ln_2.bias", (d,), as_is("layers/mlp_norm/bias", i, (d,))),
            (f"{p}.mlp.c_fc.weight", (d, f), as_is("layers/mlp/fc1/kernel", i, (d, f))),
            (f"{p}.mlp.c_fc.bias", (f,), as_is("layers/mlp/fc1/bias", i, (f,))),
            (f"{p}.mlp.c_proj.weight", (f, d), as_is("layers/mlp/fc2/kernel", i, (f, d))),
            (f"{p}.mlp.c_proj.bias", (d,), as_is("layers/mlp/fc2/bias", i, (d,))),
        ]
    out += [("transformer.ln_f.weight", (d,), lambda: source.get("final_norm/scale")),
            ("transformer.ln_f.bias", (d,), lambda: source.get("final_norm/bias"))]
    return out  # lm_head is tied to wte


def _write_shards(out: Path, entries: list[Entry], dtype: np.dtype, max_shard_bytes: int) -> list[str]:
    """Writes the tensors in order into as few shards of at most max_shard_bytes as possible."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = int(np.prod(e[1], dtype=np.int64)) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        writer = ShardWriter(out / file, [(name, shape) for name, shape, _ in shard], dtype)
        for name, shape, produce in shard:
            writer.write(name, produce())  # the only live tensor: this one
            weight_map[name] = file
        writer.close()
        total += writer.nbytes
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


# ----------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------

def _rope(m: ModelConfig) -> tuple[dict | None, dict]:
    """(legacy `rope_scaling`, `rope_parameters`) of a Llama config.json."""
    if m.rope_scaling == "none":
        return None, {"rope_type": "default", "rope_theta": m.rope_theta}
    scaling = {"rope_type": "llama3", "factor": m.rope_scaling_factor,
               "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
               "original_max_position_embeddings": m.rope_original_max_position}
    return scaling, dict(scaling, rope_theta=m.rope_theta)


def _hf_config(m: ModelConfig, arch: str, dtype: str, bos: int | None, eos: int | None) -> dict:
    common = {"architectures": [arch], "vocab_size": m.vocab_size, "initializer_range": m.init_std,
              "tie_word_embeddings": m.tie_embeddings, "bos_token_id": bos, "eos_token_id": eos,
              "use_cache": True, "torch_dtype": TORCH_DTYPE[dtype], "dtype": TORCH_DTYPE[dtype]}
    if arch == GPT2:
        return dict(common, model_type="gpt2", n_embd=m.hidden_size, n_layer=m.num_layers,
                    n_head=m.num_heads, n_inner=m.ffn_hidden_size, n_positions=m.max_position_embeddings,
                    activation_function="gelu", layer_norm_epsilon=m.norm_eps,
                    resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout,
                    attn_pdrop=m.attention_dropout, scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
    scaling, parameters = _rope(m)
    config = dict(common, model_type="llama", hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                  num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, hidden_act="silu",
                  max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_eps,
                  rope_theta=m.rope_theta, rope_parameters=parameters,
                  attention_bias=m.use_bias, mlp_bias=m.use_bias,
                  attention_dropout=m.attention_dropout, pretraining_tp=1)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

def _byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: each byte as one printable character (printable bytes as themselves,
    the others shifted above U+0100), so that any byte string is a string of vocabulary symbols."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + shifted)
            shifted += 1
    return out


def byte_tokenizer_json() -> str:
    """A `tokenizers` tokenizer with megajax's ByteTokenizer ids: 0..255 the UTF-8 bytes, 256 end-of-document."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    chars = _byte_to_char()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(EOD_TOKEN) == 256
    return tok.to_str()


def write_tokenizer(out: Path, spec: str, m: ModelConfig) -> tuple[int | None, int | None]:
    """Writes the tokenizer files for `spec` ('byte' or a tokenizer.json / its directory); (bos, eos) ids."""
    from megajax.data.tokenizer import load_tokenizer
    tok = load_tokenizer(spec, key="tokenizer")
    if tok.vocab_size > m.vocab_size:
        raise CheckpointError(f"tokenizer {spec!r} has {tok.vocab_size} ids, more than the model's "
                              f"vocab_size={m.vocab_size}; export with the tokenizer the model was trained with.")
    max_length = m.max_position_embeddings
    if spec == "byte":
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        specials = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN}
        _write_json(out / "tokenizer_config.json", dict(
            specials, tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_length,
            clean_up_tokenization_spaces=False, add_prefix_space=False))
        _write_json(out / "special_tokens_map.json", specials)
        return tok.eod_id, tok.eod_id
    from tokenizers import Tokenizer
    src = Path(tok.name)
    shutil.copyfile(src, out / "tokenizer.json")
    vocab = Tokenizer.from_file(str(src))
    bos = None
    if (src.parent / "tokenizer_config.json").is_file():
        shutil.copyfile(src.parent / "tokenizer_config.json", out / "tokenizer_config.json")
        bos_name = json.loads((src.parent / "tokenizer_config.json").read_text()).get("bos_token")
        if isinstance(bos_name, dict):
            bos_name = bos_name.get("content")
        if isinstance(bos_name, str):
            bos = vocab.token_to_id(bos_name)
    else:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                  "clean_up_tokenization_spaces": False}
        if tok.eod_id is not None:
            config["eos_token"] = vocab.id_to_token(tok.eod_id)
        _write_json(out / "tokenizer_config.json", config)
    if (src.parent / "special_tokens_map.json").is_file():
        shutil.copyfile(src.parent / "special_tokens_map.json", out / "special_tokens_map.json")
    return bos, tok.eod_id


# ----------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------

def export_hf(source, out_dir, *, tokenizer_spec: str, dtype: str = "bf16",
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Writes `source` (a TensorSource) as a Hugging Face model directory `out_dir`; returns its path.

    `dtype` ('bf16' or 'fp32') is the stored weight dtype. Raises CheckpointError
    for a model the architecture cannot express or a source that does not match
    its config; the directory appears only when complete.
    """
    m = source.model
    np_dtype = numpy_dtype(dtype)
    arch = architecture(m)
    check_source(source)
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes} must be positive.")
    entries = (_llama_entries if arch == LLAMA else _gpt2_entries)(source, m)
    with atomic_output_dir(out_dir) as tmp:
        bos, eos = write_tokenizer(tmp, tokenizer_spec, m)
        _write_json(tmp / "config.json", _hf_config(m, arch, dtype, bos, eos))
        generation = {"bos_token_id": bos, "eos_token_id": eos}
        _write_json(tmp / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
        _write_shards(tmp, entries, np_dtype, max_shard_bytes)
    return Path(out_dir)


# ----------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------

class _Weights:
    """The tensors of a Hugging Face directory (single or sharded safetensors), read on demand."""

    def __init__(self, d: Path):
        index, single = d / "model.safetensors.index.json", d / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{str(index)!r} is not a safetensors index ({e!r}).") from None
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = [single.name]
        else:
            other = [p.name for p in d.glob("pytorch_model*.bin")]
            hint = (f" It holds {', '.join(other)}: only safetensors weights are read; re-save the model "
                    f"with save_pretrained(..., safe_serialization=True).") if other else ""
            raise CheckpointError(f"{str(d)!r} holds no model.safetensors or model.safetensors.index.json."
                                  f"{hint}")
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for file in files:
            path = d / file
            if not path.is_file():
                raise CheckpointError(f"{str(d)!r}: shard {file} named by the index is missing.")
            header, start = read_header(path)
            for name, entry in header.items():
                self.entries[name] = (path, entry, start)
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.entries:
            raise CheckpointError(f"the Hugging Face checkpoint has no tensor {name}.")
        path, entry, start = self.entries[name]
        if tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(f"tensor {name} in {path.name} has shape {entry['shape']}, but config.json "
                                  f"implies {list(shape)}.")
        self.used.add(name)
        return read_tensor(path, entry, start)

    def check_all_used(self, ignore: Callable[[str], bool]) -> None:
        left = sorted(n for n in set(self.entries) - self.used if not ignore(n))
        if left:
            raise CheckpointError(f"the Hugging Face checkpoint holds tensors megajax does not know: "
                                  f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}.")


def _field(config: dict, key: str, default=None, *, required: bool = False):
    if key not in config or config[key] is None:
        if required:
            raise CheckpointError(f"config.json has no {key!r}.")
        return default
    return config[key]


def _llama_overrides(c: dict) -> dict:
    if _field(c, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act={c['hidden_act']!r}: megajax's gated MLP uses silu "
                              f"(SwiGLU); accepted: silu.")
    if _field(c, "attention_bias", False) != _field(c, "mlp_bias", False):
        raise CheckpointError(f"config.json attention_bias={c.get('attention_bias')} and mlp_bias="
                              f"{c.get('mlp_bias')} differ; megajax has one model.use_bias for both.")
    rope = dict(_field(c, "rope_parameters") or _field(c, "rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"config.json rope type {rope_type!r} is not supported; accepted: default, llama3.")
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"config.json partial_rotary_factor={partial}: megajax rotates the whole head; "
                              f"accepted: 1.0.")
    hidden, heads = _field(c, "hidden_size", required=True), _field(c, "num_attention_heads", required=True)
    out = dict(family="llama", num_layers=_field(c, "num_hidden_layers", required=True), hidden_size=hidden,
               num_heads=heads, num_kv_heads=_field(c, "num_key_value_heads", heads),
               head_dim=_field(c, "head_dim", hidden // heads),
               ffn_hidden_size=_field(c, "intermediate_size", required=True),
               vocab_size=_field(c, "vocab_size", required=True),
               max_position_embeddings=_field(c, "max_position_embeddings", 2048),
               norm="rmsnorm", activation="swiglu", position_embedding="rope",
               use_bias=bool(_field(c, "attention_bias", False)),
               tie_embeddings=bool(_field(c, "tie_word_embeddings", False)),
               norm_eps=float(_field(c, "rms_norm_eps", 1e-6)),
               rope_theta=float(rope.get("rope_theta", _field(c, "rope_theta", 10000.0))),
               attention_dropout=float(_field(c, "attention_dropout", 0.0)),
               init_std=float(_field(c, "initializer_range", 0.02)))
    if rope_type == "llama3":
        out.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                   rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                   rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)))
    return out


def _gpt2_overrides(c: dict) -> dict:
    act = _field(c, "activation_function", "gelu_new")
    if act != "gelu":
        raise CheckpointError(f"config.json activation_function={act!r}: megajax's GELU is the exact (erf) "
                              f"one; accepted: gelu.")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if _field(c, key, want) != want:
            raise CheckpointError(f"config.json {key}={c[key]}: megajax's GPT-2 needs {key}={want}.")
    hidden, heads = _field(c, "n_embd", required=True), _field(c, "n_head", required=True)
    if hidden % heads:
        raise CheckpointError(f"config.json n_embd={hidden} is not divisible by n_head={heads}.")
    return dict(family="gpt", num_layers=_field(c, "n_layer", required=True), hidden_size=hidden,
                num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                ffn_hidden_size=_field(c, "n_inner", 4 * hidden), vocab_size=_field(c, "vocab_size", required=True),
                max_position_embeddings=_field(c, "n_positions", required=True),
                norm="layernorm", activation="gelu", position_embedding="learned", use_bias=True,
                tie_embeddings=True, norm_eps=float(_field(c, "layer_norm_epsilon", 1e-5)),
                hidden_dropout=float(_field(c, "resid_pdrop", 0.0)),
                attention_dropout=float(_field(c, "attn_pdrop", 0.0)),
                init_std=float(_field(c, "initializer_range", 0.02)))


def _llama_params(w: _Weights, m: ModelConfig, padded: int, out: dict) -> None:
    d, h, kv, hd, f, v = (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_hidden_size,
                          m.vocab_size)
    out["embed/embedding"][:] = padded_zeros(w.get("model.embed_tokens.weight", (v, d)), padded, 0)
    for i in range(m.num_layers):
        p = f"model.layers.{i}"
        out["layers/attn_norm/scale"][i] = w.get(f"{p}.input_layernorm.weight", (d,))
        out["layers/mlp_norm/scale"][i] = w.get(f"{p}.post_attention_layernorm.weight", (d,))
        for proj, heads in (("q", h), ("k", kv), ("v", kv)):
            out[f"layers/attn/{proj}/kernel"][i] = (
                w.get(f"{p}.self_attn.{proj}_proj.weight", (heads * hd, d)).T.reshape(d, heads, hd))
            if m.use_bias:
                out[f"layers/attn/{proj}/bias"][i] = (
                    w.get(f"{p}.self_attn.{proj}_proj.bias", (heads * hd,)).reshape(heads, hd))
        out["layers/attn/o/kernel"][i] = w.get(f"{p}.self_attn.o_proj.weight", (d, h * hd)).T.reshape(h, hd, d)
        if m.use_bias:
            out["layers/attn/o/bias"][i] = w.get(f"{p}.self_attn.o_proj.bias", (d,))
        for hf, ours, shape in (("gate_proj", "gate", (f, d)), ("up_proj", "up", (f, d)),
                                ("down_proj", "fc2", (d, f))):
            out[f"layers/mlp/{ours}/kernel"][i] = w.get(f"{p}.mlp.{hf}.weight", shape).T
            if m.use_bias:
                out[f"layers/mlp/{ours}/bias"][i] = w.get(f"{p}.mlp.{hf}.bias", shape[:1])
    out["final_norm/scale"][:] = w.get("model.norm.weight", (d,))
    if not m.tie_embeddings:
        out["output"][:] = padded_zeros(w.get("lm_head.weight", (v, d)), padded, 0).T


def _gpt2_params(w: _Weights, m: ModelConfig, padded: int, out: dict) -> None:
    d, h, hd, f, v = m.hidden_size, m.num_heads, m.head_dim, m.ffn_hidden_size, m.vocab_size
    t = "transformer." if "transformer.wte.weight" in w else ""  # GPT2Model saves without the prefix
    out["embed/embedding"][:] = padded_zeros(w.get(f"{t}wte.weight", (v, d)), padded, 0)
    out["pos_embed"][:] = w.get(f"{t}wpe.weight", (m.max_position_embeddings, d))
    for i in range(m.num_layers):
        p = f"{t}h.{i}"
        for ln, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            out[f"layers/{ours}/scale"][i] = w.get(f"{p}.{ln}.weight", (d,))
            out[f"layers/{ours}/bias"][i] = w.get(f"{p}.{ln}.bias", (d,))
        qkv = w.get(f"{p}.attn.c_attn.weight", (d, 3 * d))
        qkv_bias = w.get(f"{p}.attn.c_attn.bias", (3 * d,))
        for k, x in enumerate("qkv"):
            out[f"layers/attn/{x}/kernel"][i] = qkv[:, k * d:(k + 1) * d].reshape(d, h, hd)
            out[f"layers/attn/{x}/bias"][i] = qkv_bias[k * d:(k + 1) * d].reshape(h, hd)
        out["layers/attn/o/kernel"][i] = w.get(f"{p}.attn.c_proj.weight", (d, d)).reshape(h, hd, d)
        out["layers/attn/o/bias"][i] = w.get(f"{p}.attn.c_proj.bias", (d,))
        out["layers/mlp/fc1/kernel"][i] = w.get(f"{p}.mlp.c_fc.weight", (d, f))
        out["layers/mlp/fc1/bias"][i] = w.get(f"{p}.mlp.c_fc.bias", (f,))
        out["layers/mlp/fc2/kernel"][i] = w.get(f"{p}.mlp.c_proj.weight", (f, d))
        out["layers/mlp/fc2/bias"][i] = w.get(f"{p}.mlp.c_proj.bias", (d,))
    out["final_norm/scale"][:] = w.get(f"{t}ln_f.weight", (d,))
    out["final_norm/bias"][:] = w.get(f"{t}ln_f.bias", (d,))


def _ignored(name: str) -> bool:
    """Tensors a Hugging Face checkpoint may carry that are not parameters (or are tied copies)."""
    return (name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"))
            or name == "lm_head.weight")


def import_hf(in_dir) -> tuple[dict, dict]:
    """Reads a Hugging Face LlamaForCausalLM or GPT2LMHeadModel directory.

    Returns (model overrides, params): the ModelConfig field values of the
    architecture, and the parameter tree as float32 numpy arrays with the
    vocabulary padded to a multiple of 128 (tensor size 1) with zero rows.
    """
    d = Path(in_dir).expanduser()
    config_file = d / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{str(d)!r} is not a Hugging Face model directory (no config.json).")
    try:
        c = json.loads(config_file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{str(config_file)!r} is not valid JSON ({e}).") from None
    arch = (c.get("architectures") or [None])[0]
    model_type = c.get("model_type")
    if arch == LLAMA or (arch is None and model_type == "llama"):
        overrides, fill = _llama_overrides(c), _llama_params
    elif arch == GPT2 or (arch is None and model_type == "gpt2"):
        overrides, fill = _gpt2_overrides(c), _gpt2_params
    else:
        raise CheckpointError(f"{str(d)!r}: architecture {arch!r} (model_type {model_type!r}) is not supported; "
                              f"megajax imports {LLAMA} and {GPT2}.")
    m = resolved_model(overrides)
    if m.vocab_size <= 0 or m.num_heads % m.num_kv_heads:
        raise CheckpointError(f"config.json: vocab_size={m.vocab_size}, num_attention_heads={m.num_heads}, "
                              f"num_key_value_heads={m.num_kv_heads} do not describe a model megajax can build.")
    padded = m.padded_vocab_size()
    flat = {name: np.zeros(shape, np.float32) for name, shape in param_shapes(m, padded).items()}
    weights = _Weights(d)
    fill(weights, m, padded, flat)
    weights.check_all_used(_ignored)
    return model_overrides(m), unflatten(dict(sorted(flat.items())))
