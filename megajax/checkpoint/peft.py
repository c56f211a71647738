"""LoRA adapters in PEFT's format: a megajax LoRA checkpoint's adapters exported as a PEFT adapter
directory for the Hugging Face export of their base, and a PEFT adapter directory read back as megajax
adapters of a base model.

PEFT (`adapter_config.json` + `adapter_model.safetensors`) names the adapter of module M
`base_model.model.M.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], M the Hugging Face
module (`model.layers.N.self_attn.q_proj`), with scale lora_alpha / r. Exported, q/k/v hold three
equal lora_A (the shared A) and their slices of B: x A B_q, x A B_k, x A B_v are exactly the fused
product's three parts. Imported, equal A's become one shared A again; different ones (an adapter
trained in PEFT) are stacked along the rank, [A_q | A_k | A_v] with B block-diagonal, and every
adapter is zero-padded to the largest rank, alpha scaled alike, so s A B is unchanged.

An import believes neither file alone (megajax/checkpoint/peft_files.py checks each): the tensors
must be pairs (lora_A with its lora_B) of the declared rank, of modules the config's target_modules
names and the base model has, with the base's input and output sizes, and every module
target_modules names must have its pair. Any disagreement is refused, naming the file, the tensor
and the values.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from megajax.checkpoint.lora import IN_PROJ, kernel_adapters
from megajax.checkpoint.peft_files import (PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS, TENSOR_NAME, PeftConfig,
                                           read_peft_config, read_peft_tensors)
from megajax.config import LoraConfig, ModelConfig
from megajax.errors import CheckpointError


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
    # target_modules: the modules' last names, as PEFT users write them, unless those name modules
    # without adapters too (adapters on some layers' linears only): then every adapted module by name.
    modules = sorted({module.rsplit(".", 1)[1] for module, *_ in rows})
    adapted = {module for module, *_ in rows}
    if {mod for mod, *_ in _adaptable(m)[1] if mod.rsplit(".", 1)[1] in modules} != adapted:
        modules = sorted(adapted)
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


def _adaptable(m: ModelConfig) -> tuple[dict, list]:
    """(megajax's parameter shapes with a rank-1 adapter on every kernel one could have, the rows of
    _linear_rows for them: every Hugging Face linear a PEFT adapter of `m` may adapt)."""
    from megajax.models.layout import param_shapes
    full = LoraConfig(rank=1, alpha=1.0, targets=_all_targets(m))
    shapes = param_shapes(dataclasses.replace(m, lora=full))
    probe = {k: np.zeros(s, np.float32) for k, s in shapes.items() if k.endswith(("/a", "/b"))}
    return shapes, _linear_rows(m, kernel_adapters(probe, m))


def hf_modules(m: ModelConfig) -> set[str]:
    """Every module name of the Hugging Face export of `m` that holds a tensor (`model.layers.0.mlp`,
    `model.layers.0.mlp.up_proj`, `lm_head`, ...), with each of its parents."""
    from megajax.checkpoint.common import tensor_shapes
    from megajax.checkpoint.hf import architecture, table
    from megajax.checkpoint.mapping import in_layer_order, rows_for
    rows = rows_for(table(architecture(m), m), tensor_shapes(m), "Hugging Face")
    out = set()
    for row, i, _ in in_layer_order(rows, m):
        for name in row.names(i):
            parts = name.split(".")[:-1]  # the tensor's module, then its parents
            out |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
    return out


def _listed(names, n: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _check_targets(c: PeftConfig, m: ModelConfig, have: set[str], adaptable: set[str], weights: Path) -> None:
    """The modules target_modules names against those the tensors adapt (`have`) and those the base has."""
    if isinstance(c.target_modules, list):
        modules = hf_modules(m)
        unknown = [t for t in c.target_modules if not any(mod == t or mod.endswith("." + t) for mod in modules)]
        if unknown:
            known = sorted({mod.rsplit(".", 1)[-1] for mod in adaptable})
            raise CheckpointError(f"{c.file}: target_modules names {_listed(unknown)}, which the base model has no "
                                  f"module of (the linears an adapter of it may have: {', '.join(known)}).")
    named = {mod for mod in adaptable if c.targets(mod) and (c.layers_to_transform is None or _layer(mod) is None
                                                              or _layer(mod) in c.layers_to_transform)}
    unnamed = have - named
    if unnamed:
        raise CheckpointError(f"{weights} holds adapters of {_listed(unnamed)}, which {c.file.name}'s target_modules "
                              f"{c.target_modules!r} does not name; the two files do not belong together.")
    bare = named - have
    if bare:
        raise CheckpointError(f"{c.file}: target_modules {c.target_modules!r} names {_listed(bare)}, whose lora_A "
                              f"and lora_B are not in {weights.name}; the two files do not belong together (an "
                              f"adapter of every module it names, or target_modules naming only those it has).")


def _layer(module: str) -> int | None:
    import re
    found = re.search(r"\.layers\.(\d+)\.", module)
    return int(found.group(1)) if found else None


def read_pairs(c: PeftConfig, tensors: dict[str, np.ndarray], weights: Path) -> dict[str, tuple]:
    """{module: (lora_A [r, in], lora_B [out, r])} of the tensors; each a whole pair of the declared rank."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    strange = []
    for name, x in tensors.items():
        found = TENSOR_NAME.match(name)
        if found is None:
            strange.append(name)
        else:
            pairs.setdefault(found.group(1), {})[found.group(2)] = x
    if strange:
        raise CheckpointError(f"{weights}: tensors that are not LoRA weights ({PEFT_PREFIX}MODULE.lora_A.weight or "
                              f".lora_B.weight): {_listed(strange)}; megajax reads plain LoRA adapters (no DoRA "
                              f"magnitudes, biases, embedding adapters or modules_to_save).")
    out = {}
    for module, ab in sorted(pairs.items()):
        half = [w for w in "AB" if w not in ab]
        if half:
            raise CheckpointError(f"{weights}: {PEFT_PREFIX}{module}.lora_{'AB'[half[0] == 'A']}.weight has no "
                                  f"lora_{half[0]}.weight beside it; an adapter is the pair.")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise CheckpointError(f"{weights}: {module}'s lora_A has shape {list(a.shape)} and its lora_B "
                                  f"{list(b.shape)}: their ranks ({a.shape[0]}, {b.shape[1]}) differ.")
        if a.shape[0] != c.r:
            raise CheckpointError(f"{weights}: {PEFT_PREFIX}{module}.lora_A.weight has rank {a.shape[0]} (shape "
                                  f"{list(a.shape)}), but {c.file.name} declares r = {c.r}; the scale lora_alpha / r "
                                  f"would be wrong.")
        out[module] = (a, b)
    return out


def import_peft(in_dir, m: ModelConfig) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """(model.lora, the adapters by path) of a PEFT LoRA adapter directory for base model `m`, both files
    checked against each other and against the model (module docstring)."""
    in_dir = Path(in_dir)
    c = read_peft_config(in_dir)
    weights = in_dir / PEFT_WEIGHTS
    pairs = read_pairs(c, read_peft_tensors(in_dir), weights)
    shapes, rows = _adaptable(m)
    by_module = {module: (slot, parts, paths) for module, slot, parts, paths in rows}
    alien = sorted(set(pairs) - set(by_module))
    if alien:
        kinds = ", ".join(sorted({k.rsplit(".", 1)[-1] for k in by_module}))
        raise CheckpointError(f"{weights}: adapters of {_listed(alien)}, which is no linear of the base model megajax "
                              f"can adapt (its {m.num_layers} layers' {kinds}).")
    _check_targets(c, m, set(pairs), set(by_module), weights)
    found: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for module, (a_ext, b_ext) in pairs.items():  # [r, in], [out, r]
        slot, parts, paths = by_module[module]
        kernel_shapes = [shapes_of_kernel(shapes, path) for path in paths]
        n_in = math.prod(kernel_shapes[0][:parts[0].n_in])
        outs = [math.prod(k[part.n_in:]) for k, part in zip(kernel_shapes, parts)]
        if a_ext.shape[1] != n_in or b_ext.shape[0] != sum(outs):
            raise CheckpointError(f"{weights}: {module}'s lora_A has shape {list(a_ext.shape)} and lora_B "
                                  f"{list(b_ext.shape)}; the base model's {module} maps {n_in} inputs to {sum(outs)} "
                                  f"outputs (lora_A [r, {n_in}], lora_B [{sum(outs)}, r]).")
        for path, part, k, b_part in zip(paths, parts, kernel_shapes, np.split(b_ext, np.cumsum(outs)[:-1])):
            found.setdefault(path, {})[0 if slot is None else slot] = (
                a_ext.T.reshape(*k[:part.n_in], a_ext.shape[0]), b_part.T.reshape(b_part.shape[1], *k[part.n_in:]))
    dropout = 0.0 if m.multi_latent_attention else c.dropout  # MLA's adapters take no input dropout
    return _pack(found, shapes, c.r, c.scale * c.r, dropout, m)

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
    # Per owner and layer: (A [in..., R], [B_k [R, out_k...]]) with R the owner's rank. A kernel or a layer
    # the PEFT adapter leaves out (q and v adapted without k; layers_to_transform) gets zeros in its
    # place: the same function, as megajax's adapters cover every kernel of a fused projection and
    # every layer of a target.
    packed, rank = {}, r
    for owner, (module, paths) in groups.items():
        present = [p for p in paths if p in found]
        n_layers = shapes[owner + "/a"][0] if owner + "/a" in shapes else None
        if n_layers is None:
            raise CheckpointError(f"the PEFT adapter adapts {', '.join(present)}, which megajax's model holds no "
                                  f"adapter of.")
        first = next(iter(found[present[0]].values()))[0]
        in_dims = first.shape[:-1]

        def zero_b(path, rows):
            return np.zeros((rows, *shapes_of_kernel(shapes, path)[len(in_dims):]), np.float32)
        per_layer = {}
        for i in range(n_layers):
            have = [p for p in present if i in found[p]]
            pairs = {p: found[p][i] for p in have}
            if not have:
                a, blocks = np.zeros((*in_dims, r), np.float32), {}
            elif all(np.array_equal(pairs[have[0]][0], x) for x, _ in pairs.values()):
                a, blocks = pairs[have[0]][0], {p: b for p, (_, b) in pairs.items()}
            else:  # stack the A's along the rank, B block-diagonal
                a = np.concatenate([pairs[p][0] for p in have], axis=-1)
                blocks = {}
                for k, p in enumerate(have):
                    blocks[p] = zero_b(p, len(have) * r)
                    blocks[p][k * r:(k + 1) * r] = pairs[p][1]
            per_layer[i] = (a, [blocks[p] if p in blocks else zero_b(p, a.shape[-1]) for p in paths])
            rank = max(rank, a.shape[-1])
        packed[owner] = (module, per_layer)
    out = {}
    for owner, (module, per_layer) in packed.items():
        n_layers = len(per_layer)
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


def _base_config(base: str, key: str) -> tuple[dict, ModelConfig, Path]:
    """(the config an import records, the base model, its directory) of a PEFT adapter's base: a megajax
    checkpoint (a run or step directory) or a Hugging Face model directory (config.json and safetensors)."""
    from megajax.checkpoint.hf import is_hf_dir
    from megajax.checkpoint.manager import find_step_dir, model_config_of, read_meta, require_step_dir
    if find_step_dir(base) is not None:
        step_dir = require_step_dir(base, key)
        saved = read_meta(step_dir)["config"]
        saved.setdefault("checkpoint", {})["load"] = str(step_dir.absolute())
        return saved, model_config_of(step_dir), step_dir
    if is_hf_dir(base):
        from megajax.checkpoint.common import imported_tokenizer, resolved_model
        from megajax.checkpoint.hf import hf_model_overrides, hf_tokenizer
        d = Path(base).expanduser()
        overrides = hf_model_overrides(d)
        found, known = hf_tokenizer(d)
        tokenizer, _ = imported_tokenizer(found, overrides["vocab_size"], known)
        saved = {"model": overrides, "data": {"tokenizer": tokenizer}, "checkpoint": {"load": str(d.absolute())}}
        if overrides.get("max_position_embeddings"):
            saved["train"] = {"seq_len": min(overrides["max_position_embeddings"], 2048)}
        return saved, resolved_model(overrides), d
    raise CheckpointError(f"{key} = {base!r}: neither a megajax checkpoint (a run or step directory) nor a Hugging "
                          f"Face model directory (config.json beside model.safetensors) here; a model hub name is "
                          f"not downloaded.")


def import_peft_checkpoint(in_dir, base: str | None, out_dir) -> tuple[Path, LoraConfig, Path]:
    """`megajax import --format peft`: (the megajax LoRA checkpoint written from the PEFT adapter directory
    `in_dir`, its model.lora, its base's directory). The base is `base` or the adapter's
    base_model_name_or_path: a megajax checkpoint or a Hugging Face directory, recorded as the
    checkpoint's `lora_base` (so generate, serve, export and training resume find and check it)."""
    from megajax.checkpoint.lora_base import base_reference
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.checkpoint.source import unflatten
    from megajax.config import load_config
    c = read_peft_config(in_dir)  # a bad config is refused before the base is read
    key = "--base"
    if base is None:
        if not c.base:
            raise CheckpointError(f"import --format peft needs --base DIR, the base model (a megajax "
                                  f"checkpoint or a Hugging Face directory): {c.file} names none in "
                                  f"base_model_name_or_path.")
        base, key = c.base, f"{c.file.name}'s base_model_name_or_path (pass --base DIR to name another)"
    saved, model, base_dir = _base_config(base, key)
    lora, adapters = import_peft(in_dir, model)
    saved["model"] = dataclasses.asdict(dataclasses.replace(model, lora=lora))
    from megajax.checkpoint.common import check_tokenizer
    from megajax.checkpoint.lora import adapter_tokenizer
    tokenizer = adapter_tokenizer(in_dir)  # one saved beside the adapters (its chat template) wins
    if tokenizer is not None:
        check_tokenizer(tokenizer, model)
        saved.setdefault("data", {})["tokenizer"] = tokenizer
    cfg = load_config(base=saved)
    step_dir = write_params_checkpoint(unflatten(adapters), cfg, out_dir, meta={"lora_base": base_reference(cfg)})
    return step_dir, lora, base_dir
