"""Low-rank adapters outside training: merged into their base (a Hugging Face export with
--merge-lora, generation and serving with --adapter), and in PEFT's format (export and import).

A LoRA checkpoint holds the adapters (`.../qkv_lora/{a,b}`, `.../gate_up_lora/{a,b}`,
`.../lora/{a,b}`, megajax/models/lora.py) and names its base (`lora_base` in its metadata). Per
base kernel W[in..., out...] an adapter is a pair A[in..., r], B[r, out...] with W' = W + s A B,
s = alpha / rank. A fused adapter gives each of its kernels the shared A and that kernel's slice of
B (q, k, v of `qkv`: B[r, G, group + 2, K] -> B_q[r, H, K] (heads g-major), B_k[r, G, K], B_v; gate
and up of `gate_up`: B[r, F, 2] -> B[..., 0], B[..., 1]).

PEFT (`adapter_config.json` + `adapter_model.safetensors`) names the adapter of module M
`base_model.model.M.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], M the Hugging Face
module (`model.layers.N.self_attn.q_proj`), with scale lora_alpha / r. Exported, q/k/v hold three
equal lora_A (the shared A) and their slices of B: x A B_q, x A B_k, x A B_v are exactly the fused
product's three parts. Imported, equal A's become one shared A again; different ones (an adapter
trained in PEFT) are stacked along the rank, [A_q | A_k | A_v] with B block-diagonal, and every
adapter is zero-padded to the largest rank, alpha scaled alike, so s A B is unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from megajax.config import LoraConfig, ModelConfig
from megajax.errors import CheckpointError

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def kernel_adapters(adapters: dict[str, np.ndarray], m: ModelConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{base kernel path: (A [stack, in..., r], B [stack, r, out...])} from the adapters by path
    (`layers/attn/qkv_lora/a`, ...; stacked like their kernels)."""
    out = {}
    for path, a in adapters.items():
        if not path.endswith("/a"):
            continue
        owner, b = path[:-len("/a")], adapters[path[:-len("/a")] + "/b"]
        parent, module = owner.rsplit("/", 1)
        if module == "lora":
            out[parent + "/kernel"] = (a, b)
        elif module == "qkv_lora":  # b [L, r, G, group + 2, K]
            group = b.shape[3] - 2
            q = b[:, :, :, :group].reshape(b.shape[0], b.shape[1], -1, b.shape[4])
            out.update({parent + "/q/kernel": (a, q), parent + "/k/kernel": (a, b[:, :, :, group]),
                        parent + "/v/kernel": (a, b[:, :, :, group + 1])})
        elif module == "gate_up_lora":  # b [L, r, F, 2]
            out.update({parent + "/gate/kernel": (a, b[..., 0]), parent + "/up/kernel": (a, b[..., 1])})
        elif module == "experts_fc1_lora":  # a [L, E, D, r], b [L, E, r, F] or [L, E, r, F, 2] (gate, up)
            out.update({parent + "/gate": (a, b[..., 0]), parent + "/up": (a, b[..., 1])} if b.ndim == 5 else
                       {parent + "/fc1": (a, b)})
        elif module == "experts_fc2_lora":
            out[parent + "/fc2"] = (a, b)
        elif module == "in_proj_lora":  # b [L, r, G, z | x | B | C | dt]: the group's H / G heads of z, x, dt
            out.update({f"{parent}/{x}/kernel": (a, part) for x, part in zip(IN_PROJ, in_proj_parts(b, m))})
        else:
            raise CheckpointError(f"adapter parameter {path}: unknown adapter module {module!r}.")
    return out


IN_PROJ = ("z", "x", "B", "C", "dt")  # a Mamba-2 mixer's in_proj parts, in the fused kernel's order


def in_proj_parts(b: np.ndarray, m: ModelConfig) -> list[np.ndarray]:
    """A Mamba in_proj adapter's B [..., r, G, z | x | B | C | dt] as the five kernels' B's: z, x
    [..., r, H, P] (heads group-major), B, C [..., r, G, N], dt [..., r, H]."""
    h, p, g, n = m.mamba_num_heads, m.mamba_head_dim, m.mamba_num_groups, m.mamba_state_dim
    lead = b.shape[:-2]
    z, x, bm, cm, dt = np.split(b, np.cumsum([h // g * p, h // g * p, n, n]), axis=-1)
    return [z.reshape(*lead, h, p), x.reshape(*lead, h, p), bm, cm, dt.reshape(*lead, h)]


def delta(a: np.ndarray, b: np.ndarray, scale: float, shape: tuple[int, ...]) -> np.ndarray:
    """s A B for one layer: A [in..., r], B [r, out...] -> [in..., out...] (`shape`); routed experts'
    A [E, in, r], B [E, r, out] -> [E, in, out], expert by expert."""
    if a.ndim == b.ndim == len(shape) == 3 and a.shape[0] == b.shape[0] == shape[0] and a.shape[2] == b.shape[1]:
        return scale * np.einsum("eir,ero->eio", a.astype(np.float64), b.astype(np.float64))
    r = a.shape[-1]
    return (scale * (a.reshape(-1, r).astype(np.float64) @ b.reshape(r, -1).astype(np.float64))).reshape(shape)


class MergedSource:
    """A TensorSource (names, shape, get(name, layer), model) of the base with the adapters merged in:
    what a Hugging Face export with --merge-lora writes and generation with --adapter loads."""

    def __init__(self, base, adapters: dict[str, np.ndarray], lora: LoraConfig):
        self.base, self.lora = base, lora
        self.model = dataclasses.replace(base.model, lora=None)
        self.step_dir = getattr(base, "step_dir", None)
        self.kernels = kernel_adapters(adapters, self.model)
        self.trained = trained_beside(adapters)  # a vision-language model's projector (encoder): in place of the base's
        missing = sorted((set(self.kernels) | set(self.trained)) - set(base.names()))
        if missing:
            raise CheckpointError(f"the adapters belong to kernels the base model lacks: {', '.join(missing[:4])}.")

    def names(self) -> list[str]:
        return self.base.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def stored(self, key: str):
        return self.base.stored(key)

    def get(self, name: str, layer: int | None = None) -> np.ndarray:
        if name in self.trained:
            w = self.trained[name]
            return w if layer is None else w[layer]
        w = self.base.get(name, layer)
        if name not in self.kernels:
            return w
        a, b = self.kernels[name]
        scale = self.lora.alpha / self.lora.rank
        if layer is not None:
            return (w + delta(a[layer], b[layer], scale, w.shape)).astype(np.float32)
        return np.stack([w[i] + delta(a[i], b[i], scale, w.shape[1:]) for i in range(w.shape[0])]).astype(np.float32)


def read_adapters(source) -> dict[str, np.ndarray]:
    """Every parameter of a LoRA checkpoint (a CheckpointSource of its parameters), whole: the adapters, and
    what trained beside them (a vision-language model's projector, its encoder unless frozen; `trained_beside`)."""
    from megajax.models.trainable import frozen_parameters
    frozen = frozen_parameters(source.model)
    return {name: source.get(name) for name in source.names() if not frozen(name)}


def trained_beside(adapters: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters of a LoRA checkpoint that are not adapters: they replace the base's (trainable.py)."""
    from megajax.models.lora import is_adapter
    return {name: x for name, x in adapters.items() if not is_adapter(tuple(name.split("/")))}


# ----------------------------------------------------------------------------
# PEFT
# ----------------------------------------------------------------------------

def _linear_rows(m: ModelConfig, kernels: dict) -> list[tuple[str, int | None, tuple, tuple]]:
    """(Hugging Face module name, stack index, Parts, kernel paths) of every adapted Hugging Face
    linear, in the Hugging Face table's layer order: one kernel, or the kernels a fused Hugging Face
    linear holds side by side along its output (a Mamba mixer's in_proj: z, x, B, C, dt)."""
    from megajax.checkpoint.common import tensor_shapes  # noqa: F401  (the table needs the shapes)
    from megajax.checkpoint.hf import architecture, table
    from megajax.checkpoint.mapping import in_layer_order, rows_for
    from megajax.models.layout import param_shapes
    arch = architecture(m)
    shapes = param_shapes(m)
    rows = rows_for(table(arch, m), {k: v for k, v in shapes.items()}, "Hugging Face " + arch)
    out = []
    for row, i, slot in in_layer_order(rows, m):
        if len(row.names(i)) != 1 or any(p.kind != "linear" or p.path not in kernels for p in row.parts):
            continue
        name = row.names(i)[0]
        assert name.endswith(".weight") and len({p.n_in for p in row.parts}) == 1, name
        out.append((name[:-len(".weight")], slot, row.parts, tuple(p.path for p in row.parts)))
    return out


def export_peft(adapters: dict[str, np.ndarray], m: ModelConfig, lora: LoraConfig, out_dir, *,
                base: str = "", dtype: str = "fp32", tokenizer_spec: str | None = None,
                chat_template: str | None = None) -> Path:
    """Writes the adapters as a PEFT LoRA adapter directory (adapter_config.json,
    adapter_model.safetensors) for the Hugging Face export of the base model `m`; with `tokenizer_spec`
    the run's tokenizer beside them (as transformers' Trainer saves an adapter: its chat template
    included)."""
    from megajax.checkpoint.common import atomic_output_dir, check_tokenizer
    from megajax.data.tokenizer import save_hf_tokenizer
    from megajax.checkpoint.dtypes import numpy_dtype
    from megajax.checkpoint.hf import _write_json, _write_safetensors
    from megajax.checkpoint.mapping import Part
    if m.vision is not None:
        raise CheckpointError("model.vision: the adapters of a vision-language model are not exported in PEFT's "
                              "format (its projector trains beside them, which a PEFT LoRA adapter of transformers' "
                              "LLaVA would carry as modules_to_save; not written); export the merged model "
                              "(export --format hf --merge-lora).")
    experts = sorted(k for k in adapters if "/experts_fc" in k)
    if experts:
        raise CheckpointError(f"model.lora.targets holds experts (the routed experts' adapters, {experts[0]}, ...): "
                              f"PEFT's LoRA format has no per-expert adapters of the stacked expert weights "
                              f"transformers holds; export the merged model (export --format hf --merge-lora) or "
                              f"train without `experts`.")
    kernels = kernel_adapters(adapters, m)
    mamba_out = sorted(k for k in kernels if k.endswith("/mixer/out/kernel"))
    if mamba_out:  # peft.tuners refuses out_proj (and conv1d) of Mamba models: fused kernels bypass its forward
        raise CheckpointError(f"model.lora.targets holds out_proj (the Mamba mixers' output, {mamba_out[0]}, ...): "
                              f"PEFT refuses LoRA on a Mamba model's out_proj; export the merged model "
                              f"(export --format hf --merge-lora) or train without out_proj.")
    rows = _linear_rows(m, kernels)
    if sum(len(r[3]) for r in rows) != sum(kernels[k][0].shape[0] for k in kernels):
        raise CheckpointError(f"some adapters have no Hugging Face module to go with: "
                              f"{sorted(set(kernels) - {p for r in rows for p in r[3]})}.")
    tensors = []
    for module, slot, parts, paths in rows:
        pairs = [kernels[path] if slot is None else (kernels[path][0][slot], kernels[path][1][slot]) for path in paths]
        a = pairs[0][0]  # one shared A where the kernels are one Hugging Face linear (kernel_adapters)
        assert all(np.array_equal(a, other) for other, _ in pairs), module
        ext_a = Part(paths[0], "linear", n_in=parts[0].n_in).to_external(a)  # [r, in]
        ext_b = np.concatenate([Part(p, "linear", n_in=1).to_external(b) for p, (_, b) in zip(paths, pairs)])  # [out, r]
        for which, x in (("lora_A", ext_a), ("lora_B", ext_b)):
            tensors.append((f"{PEFT_PREFIX}{module}.{which}.weight", x.shape, lambda x=x: x))
    modules = sorted({module.rsplit(".", 1)[1] for module, *_ in rows})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "base_model_name_or_path": base, "modules_to_save": None,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "layers_to_transform": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    tok = None if tokenizer_spec is None else check_tokenizer(tokenizer_spec, m)
    with atomic_output_dir(out_dir) as tmp:
        if tok is not None:
            save_hf_tokenizer(tok, tmp, max_length=m.max_position_embeddings, chat_template=chat_template)
        _write_json(tmp / PEFT_CONFIG, config)
        _write_safetensors(tmp / PEFT_WEIGHTS, tensors, numpy_dtype(dtype))
    return Path(out_dir)


def import_peft(in_dir, m: ModelConfig) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """(model.lora, the adapters by path) of a PEFT LoRA adapter directory for base model `m`."""
    from safetensors.numpy import load_file
    in_dir = Path(in_dir)
    cfg_file, weights = in_dir / PEFT_CONFIG, in_dir / PEFT_WEIGHTS
    for f in (cfg_file, weights):
        if not f.is_file():
            raise CheckpointError(f"{in_dir}: not a PEFT adapter directory (no {f.name}).")
    c = json.loads(cfg_file.read_text())
    if c.get("peft_type", "LORA") != "LORA" or c.get("use_dora") or c.get("use_rslora") or c.get("rank_pattern") \
            or c.get("alpha_pattern") or c.get("fan_in_fan_out"):
        raise CheckpointError(f"{cfg_file}: megajax reads plain LoRA adapters (peft_type LORA without DoRA, rsLoRA, "
                              f"per-module rank or alpha patterns, fan_in_fan_out); this one has "
                              f"{ {k: c.get(k) for k in ('peft_type', 'use_dora', 'use_rslora', 'fan_in_fan_out')} }.")
    r, alpha = int(c["r"]), float(c["lora_alpha"])
    stored = load_file(str(weights))
    # Which megajax adapters the file's modules make: every kernel an adapter of the model could have.
    full = LoraConfig(rank=r, alpha=alpha, targets=_all_targets(m))
    from megajax.models.layout import param_shapes
    shapes = param_shapes(dataclasses.replace(m, lora=full))
    probe = {k: np.zeros(s, np.float32) for k, s in shapes.items() if k.endswith(("/a", "/b"))}
    rows = _linear_rows(m, kernel_adapters(probe, m))
    found: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    used = set()
    for module, slot, parts, paths in rows:
        ka, kb = f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"
        if ka not in stored:
            continue
        used |= {ka, kb}
        a_ext, b_ext = stored[ka].astype(np.float32), stored[kb].astype(np.float32)  # [r, in], [out, r]
        kernel_shapes = [shapes_of_kernel(shapes, path) for path in paths]
        outs = [math.prod(k[part.n_in:]) for k, part in zip(kernel_shapes, parts)]
        if b_ext.shape[0] != sum(outs):
            raise CheckpointError(f"{weights}: {kb} has {b_ext.shape[0]} output rows; {module} has {sum(outs)}.")
        for path, part, k, b_part in zip(paths, parts, kernel_shapes, np.split(b_ext, np.cumsum(outs)[:-1])):
            found.setdefault(path, {})[0 if slot is None else slot] = (
                a_ext.T.reshape(*k[:part.n_in], a_ext.shape[0]), b_part.T.reshape(b_part.shape[1], *k[part.n_in:]))
    unused = sorted(set(stored) - used)
    if unused:
        raise CheckpointError(f"{weights}: tensors megajax's model has no place for: {', '.join(unused[:4])}"
                              f"{' ...' if len(unused) > 4 else ''}.")
    if not found:
        raise CheckpointError(f"{weights}: holds no LoRA tensor of this model's linears.")
    return _pack(found, shapes, r, alpha, c.get("lora_dropout", 0.0), m)


def shapes_of_kernel(shapes: dict, path: str) -> tuple[int, ...]:
    from megajax.models.layout import stacked
    s = shapes[path]
    return s[1:] if stacked(path) or path.startswith("mtp/") else s


def _all_targets(m: ModelConfig) -> list[str]:
    if m.hybrid_layer_pattern:
        kinds = set(m.hybrid_layer_pattern)
        return ((["in_proj", "out_proj"] if "M" in kinds else []) + (["qkv", "proj"] if "*" in kinds else [])
                + (["fc1", "fc2"] if "-" in kinds or ("E" in kinds and m.moe_shared_expert_ffn_size) else []))
    if m.multi_latent_attention:
        q = ["q_down_proj", "q_up_proj"] if m.q_lora_rank is not None else ["q_proj"]
        return q + ["kv_down_proj", "kv_up_proj", "proj", "fc1", "fc2"]
    return ["qkv", "proj", "fc1", "fc2"]


_FUSED = {"qkv_lora": ("q", "k", "v"), "gate_up_lora": ("gate", "up"), "in_proj_lora": IN_PROJ}
_TARGET_OF = {"qkv_lora": "qkv", "gate_up_lora": "fc1", "in_proj_lora": "in_proj", "out": "out_proj",
              "o": "proj", "fc1": "fc1", "fc2": "fc2", "q": "q_proj",
              "q_down": "q_down_proj", "q_up": "q_up_proj", "kv_down": "kv_down_proj", "kv_up": "kv_up_proj"}


def _pack(found: dict, shapes: dict, r: int, alpha: float, dropout: float, m: ModelConfig):
    """megajax adapters (stacked per layer) from per-kernel (A, B) pairs per layer slot."""
    groups: dict[str, tuple[str, list[str]]] = {}  # adapter owner path -> (module, kernel paths)
    for path in found:
        parent, kernel = path[:-len("/kernel")].rsplit("/", 1)
        fused = next((mod for mod, ks in _FUSED.items() if kernel in ks and parent.split("/")[-1] in
                      ("attn", "mlp", "mixer")), None)
        if fused and not (m.multi_latent_attention and fused == "qkv_lora"):
            groups.setdefault(f"{parent}/{fused}", (fused, [f"{parent}/{k}/kernel" for k in _FUSED[fused]]))
        else:
            groups[f"{parent}/{kernel}/lora"] = ("lora", [path])
    # Per owner and layer: (A [in..., R], [B_k [R, out_k...]]) with R the owner's rank.
    packed, rank = {}, r
    for owner, (module, paths) in groups.items():
        missing = [p for p in paths if p not in found]
        if missing:
            raise CheckpointError(f"the PEFT adapter adapts some of {', '.join(paths)} but not {', '.join(missing)}: "
                                  f"megajax adapts them together (one fused projection).")
        layers = sorted(found[paths[0]])
        per_layer = {}
        for i in layers:
            pairs = [found[p][i] for p in paths]
            if all(np.array_equal(pairs[0][0], a) for a, _ in pairs):
                per_layer[i] = (pairs[0][0], [b for _, b in pairs])
            else:  # stack the A's along the rank, B block-diagonal
                n = len(pairs)
                a = np.concatenate([a for a, _ in pairs], axis=-1)
                bs = []
                for k, (_, b) in enumerate(pairs):
                    z = np.zeros((n * r, *b.shape[1:]), np.float32)
                    z[k * r:(k + 1) * r] = b
                    bs.append(z)
                per_layer[i] = (a, bs)
            rank = max(rank, per_layer[i][0].shape[-1])
        packed[owner] = (module, per_layer)
    out = {}
    for owner, (module, per_layer) in packed.items():
        n_layers = shapes[owner + "/a"][0] if owner + "/a" in shapes else None
        if n_layers is None or sorted(per_layer) != list(range(n_layers)):
            raise CheckpointError(f"the PEFT adapter adapts {owner} in layers {sorted(per_layer)} only; megajax's "
                                  f"adapters cover every layer of a target (PEFT's layers_to_transform is not read).")
        a_layers, b_layers = [], []
        for i in range(n_layers):
            a, bs = per_layer[i]
            pad = rank - a.shape[-1]
            a = np.concatenate([a, np.zeros((*a.shape[:-1], pad), np.float32)], axis=-1)
            bs = [np.concatenate([b, np.zeros((pad, *b.shape[1:]), np.float32)]) for b in bs]
            if module == "qkv_lora":  # [R, G, group + 2, K]
                q, k, v = bs
                g = k.shape[1]
                b = np.concatenate([q.reshape(rank, g, -1, q.shape[-1]), k[:, :, None], v[:, :, None]], axis=2)
            elif module == "gate_up_lora":
                b = np.stack(bs, axis=-1)
            elif module == "in_proj_lora":  # [R, G, z | x | B | C | dt]
                z, x, bm, cm, dt = bs
                g = bm.shape[1]
                b = np.concatenate([z.reshape(rank, g, -1), x.reshape(rank, g, -1), bm, cm, dt.reshape(rank, g, -1)],
                                   axis=2)
            else:
                b = bs[0]
            a_layers.append(a)
            b_layers.append(b)
        out[owner + "/a"], out[owner + "/b"] = np.stack(a_layers), np.stack(b_layers)
    targets = sorted({_TARGET_OF[o.rsplit("/", 2)[-1] if o.endswith("_lora") else o.rsplit("/", 2)[-2]]
                      for o in packed})
    lora = LoraConfig(rank=rank, alpha=alpha * rank / r, dropout=float(dropout), targets=targets)
    return lora, out


def load_adapter(path, m: ModelConfig) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """(model.lora, adapters by path) of --adapter DIR: a megajax LoRA checkpoint (a run or step
    directory) or a PEFT adapter directory, for base model `m`."""
    from megajax.checkpoint.manager import CheckpointSource, find_step_dir
    path = Path(path)
    if (path / PEFT_CONFIG).is_file():
        return import_peft(path, m)
    if find_step_dir(path) is None:
        raise CheckpointError(f"--adapter {path}: neither a megajax LoRA checkpoint nor a PEFT adapter directory "
                              f"({PEFT_CONFIG}).")
    source = CheckpointSource(path, key="--adapter")
    if source.model.lora is None:
        raise CheckpointError(f"--adapter {path}: a megajax checkpoint without LoRA adapters (model.lora unset).")
    theirs = dataclasses.replace(source.model, lora=None)
    if theirs != dataclasses.replace(m, lora=None):
        diff = [f.name for f in dataclasses.fields(m) if getattr(theirs, f.name) != getattr(m, f.name)]
        raise CheckpointError(f"--adapter {path}: its adapters belong to another model (model.{', model.'.join(diff[:4])} "
                              f"differ from the base's).")
    return source.model.lora, read_adapters(source)


def adapter_tokenizer(path) -> str | None:
    """The data.tokenizer that goes with --adapter DIR, or None (the base's then): the tokenizer a PEFT
    adapter directory carries (tokenizer.json beside adapter_config.json, as transformers' Trainer and
    `megajax export --format peft` save it: its chat template may be the fine-tuning's), or a megajax
    LoRA checkpoint's own data.tokenizer."""
    from megajax.checkpoint.common import tokenizer_dir_spec
    from megajax.checkpoint.manager import find_step_dir, read_meta
    path = Path(path)
    if (path / PEFT_CONFIG).is_file():
        return tokenizer_dir_spec(path)
    step_dir = find_step_dir(path)
    if step_dir is None:
        return None
    return read_meta(step_dir).get("config", {}).get("data", {}).get("tokenizer")


def merge_adapter(params: dict, path, m: ModelConfig) -> tuple[dict, str]:
    """(the parameters (nested, on their devices) with the adapters of `path` merged in, a note)."""
    import jax
    lora, adapters = load_adapter(path, m)
    kernels = kernel_adapters(adapters, m)
    trained = trained_beside(adapters)
    scale = lora.alpha / lora.rank
    out = dict(params)

    def put(tree, keys, fn):
        node = dict(tree)
        node[keys[0]] = fn(tree[keys[0]]) if len(keys) == 1 else put(tree[keys[0]], keys[1:], fn)
        return node

    def merged(w):
        a, b = kernels[name]
        host = np.asarray(jax.device_get(w), np.float32)
        new = np.stack([host[i] + delta(a[i], b[i], scale, host.shape[1:]) for i in range(host.shape[0])])
        return jax.device_put(new.astype(w.dtype), w.sharding)

    def replaced(w):
        x = trained[name]
        if x.shape != w.shape:
            raise CheckpointError(f"--adapter {path}: {name} has shape {list(x.shape)}, the base model's "
                                  f"{list(w.shape)}.")
        return jax.device_put(x.astype(w.dtype), w.sharding)

    for name in [*kernels, *trained]:
        try:
            out = put(out, name.split("/"), merged if name in kernels else replaced)
        except KeyError:
            raise CheckpointError(f"--adapter {path}: adapts {name}, which the base model lacks.") from None
    return out, (f"LoRA adapters from {path} merged in (rank {lora.rank}, alpha {lora.alpha:g}, "
                 f"{len(kernels)} kernels)")
