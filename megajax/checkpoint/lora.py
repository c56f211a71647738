"""Low-rank adapters outside training: merged into their base (an export with --merge-lora, generation
and serving with --adapter or from a LoRA checkpoint, the exact-match score of a LoRA run).

A LoRA checkpoint holds the adapters (`.../qkv_lora/{a,b}`, `.../gate_up_lora/{a,b}`,
`.../lora/{a,b}`, megajax/models/lora.py) and names its base (`lora_base` in its metadata). Per
base kernel W[in..., out...] an adapter is a pair A[in..., r], B[r, out...] with W' = W + s A B,
s = alpha / rank. A fused adapter gives each of its kernels the shared A and that kernel's slice of
B (q, k, v of `qkv`: B[r, G, group + 2, K] -> B_q[r, H, K] (heads g-major), B_k[r, G, K], B_v; gate
and up of `gate_up`: B[r, F, 2] -> B[..., 0], B[..., 1]).

In PEFT's format: megajax/checkpoint/peft.py; the base a checkpoint's adapters belong to and its
check: megajax/checkpoint/lora_base.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from megajax.config import LoraConfig, ModelConfig
from megajax.errors import CheckpointError


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


def load_adapter(path, m: ModelConfig) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """(model.lora, adapters by path) of --adapter DIR: a megajax LoRA checkpoint (a run or step
    directory) or a PEFT adapter directory, for base model `m`."""
    from megajax.checkpoint.manager import CheckpointSource, find_step_dir
    from megajax.checkpoint.peft import PEFT_CONFIG, import_peft
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
    from megajax.checkpoint.peft import PEFT_CONFIG
    path = Path(path)
    if (path / PEFT_CONFIG).is_file():
        return tokenizer_dir_spec(path)
    step_dir = find_step_dir(path)
    if step_dir is None:
        return None
    return read_meta(step_dir).get("config", {}).get("data", {}).get("tokenizer")


def merge_adapter(params: dict, path, m: ModelConfig, base=None) -> tuple[dict, str]:
    """(the parameters (nested, on their devices) with the adapters of `path` (load_adapter) merged in, a note).

    `base`: the directory the parameters came from. Adapters of a megajax LoRA checkpoint merged into the
    base they record are checked against it (lora_base.verified_base: not saved over since); merged into
    another model, as asked, the note names the base they were trained on."""
    lora, adapters = load_adapter(path, m)
    trained_on = ""
    from megajax.checkpoint.manager import find_step_dir, read_meta
    step_dir = find_step_dir(path) if base is not None else None
    ref = read_meta(step_dir).get("lora_base") if step_dir is not None else None
    if ref and ref.get("path"):
        if Path(ref["path"]).resolve() == Path(base).resolve():
            from megajax.checkpoint.lora_base import verified_base
            verified_base(ref, f"--adapter {path}")
        else:
            trained_on = f"; trained on {ref['path']}, merged into {base} as asked"
    return merge_adapters(params, lora, adapters, m, f"--adapter {path}"), (
        f"LoRA adapters from {path} merged in (rank {lora.rank}, alpha {lora.alpha:g}, "
        f"{len(kernel_adapters(adapters, m))} kernels{trained_on})")


def merge_adapters(params: dict, lora: LoraConfig, adapters: dict[str, np.ndarray], m: ModelConfig,
                   where: str) -> dict:
    """The base parameters `params` (nested, on their devices) with `adapters` (by path, on the host)
    merged in: W + (alpha / rank) A B in fp32 for each adapted kernel, one kernel at a time on the host,
    placed back with the kernel's dtype and sharding; what trained beside the adapters replaces the
    base's. The model this computes is `m` without model.lora."""
    import jax
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
            raise CheckpointError(f"{where}: {name} has shape {list(x.shape)}, the base model's {list(w.shape)}.")
        return jax.device_put(x.astype(w.dtype), w.sharding)

    for name in [*kernels, *trained]:
        try:
            out = put(out, name.split("/"), merged if name in kernels else replaced)
        except KeyError:
            raise CheckpointError(f"{where}: adapts {name}, which the base model lacks.") from None
    return out
