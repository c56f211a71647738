"""Analytic training FLOPs and MFU.

Convention (model FLOPs, as in MFU): per token, training costs 3x the
forward matmul FLOPs, i.e. 6 x (matmul parameters, output layer included,
embedding lookups and norms excluded), plus attention 6 x layers x seq x
(heads x head_dim) for QK^T and AV with causal masking counted over the
lower triangle only (half of full attention). Recomputation is not counted.
A mixture-of-experts layer counts its active parameters: the router, the
top-k experts a token goes through (all experts' kernels x topk / num_experts)
and the shared expert, which every token goes through.

A hybrid model counts attention for its attention layers only, and for each Mamba-2 layer the SSD's
chunked products (ssd_flops_per_token), 3x forward like every other product.
"""

from __future__ import annotations

import math
import os
import re

from megajax.config import ModelConfig
from megajax.models.layout import param_shapes
from megajax.models.vision import encoder_forward_flops

# Dense peak TFLOP/s per device by precision (vendor datasheets; fp32 uses TF32 tensor cores).
PEAK_TFLOPS = {
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 494.7},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 494.7},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "fp32": 163.4},
    # MI250X / MI250: per graphics compute die (the device JAX sees; two per module); MI250X first, as
    # a device kind naming it also holds "MI250"
    "MI250X": {"bf16": 191.5, "fp16": 191.5, "fp32": 47.9},
    "MI250": {"bf16": 181.0, "fp16": 181.0, "fp32": 45.3},
}


# The routed experts' kernels, of the MoE layers and of a MoE multi-token prediction block.
EXPERT_KERNEL = r"(layers|mtp/block)/mlp/(gate|up|fc1|fc2)"


def expert_kernel_pattern(cfg: ModelConfig) -> str:
    """The names of the routed experts' stacked kernels (a hybrid's: its E layers' mixers)."""
    if cfg.hybrid_layer_pattern:
        slots = "|".join(str(j) for j, kind in enumerate(cfg.hybrid_group()) if kind == "E") or "-"
        return rf"layers/layer({slots})/mixer/(gate|up|fc1|fc2)"
    return EXPERT_KERNEL


def ssd_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one Mamba-2 layer's chunked SSD (chunks of Q = min(chunk size, seq)
    tokens, H heads of P, G groups, state N): the causal half of each chunk's C B^T scores (G Q N) and
    of the scores times x (H Q P), the chunk states B^T x and the outputs C h from the carried states
    (2 H P N each). The inter-chunk recurrence (H P N per chunk) is left out."""
    q = min(cfg.mamba_chunk_size, seq_len)
    h, p, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim
    return float(g * q * n + h * q * p + 4 * h * p * n)


def matmul_params(cfg: ModelConfig, padded_vocab: int) -> int:
    """Parameters each token multiplies: every projection kernel of the model's layout (shared
    expert included; of the routed experts, the top-k a token is routed to), and the output layer
    (the embedding table when tied)."""
    shapes = {k: v for k, v in param_shapes(cfg, padded_vocab).items()
              if not k.startswith(("vision/", "projector/"))}  # per image, not per token: vision_flops_per_token
    kernels = sum(math.prod(s) for name, s in shapes.items() if name.endswith("/kernel"))
    if cfg.num_experts:  # the routed experts' stacked kernels: {layers,mtp/block}/mlp/{gate,up,fc1,fc2} [L, E, ...]
        pattern = expert_kernel_pattern(cfg)
        experts = sum(math.prod(s) for name, s in shapes.items() if re.fullmatch(pattern, name))
        routers = sum(math.prod(s) for name, s in shapes.items()
                      if name.endswith("/mlp/router") or (cfg.hybrid_layer_pattern and name.endswith("/mixer/router")))
        kernels += experts * cfg.moe_router_topk // cfg.num_experts + routers
    # the output layer, once more per multi-token prediction depth
    return kernels + (1 + cfg.mtp_num_layers) * math.prod(shapes.get("output", shapes["embed/embedding"]))


def train_flops_per_token(cfg: ModelConfig, seq_len: int, padded_vocab: int) -> float:
    # Multi-latent attention: QK^T over qk_head_dim + qk_pos_emb_head_dim dims, AV over v_head_dim.
    dims = ((cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim) / 2 if cfg.multi_latent_attention
            else cfg.head_dim)
    if cfg.hybrid_layer_pattern:
        attention = 6 * cfg.attention_layers() * seq_len * cfg.num_heads * dims
        mamba = cfg.mamba_layers()
        ssd = 3 * mamba * ssd_flops_per_token(cfg, seq_len) if mamba else 0.0
        return 6.0 * matmul_params(cfg, padded_vocab) + attention + ssd + vision_flops_per_token(cfg, seq_len)
    attention = 6 * (cfg.num_layers + cfg.mtp_num_layers) * seq_len * cfg.num_heads * dims
    return 6.0 * matmul_params(cfg, padded_vocab) + attention + vision_flops_per_token(cfg, seq_len)


def vision_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """A vision-language model's image encoder and projector per text token, counted for one image per
    sequence (LLaVA's samples; model.vision.max_tiles pictures when tiled, the loader's tile axis, all
    encoded): the encoder layers that run (to model.vision.feature_layer: matmuls and
    attention) and the patch embedding 3x forward, 1x when model.vision.freeze (no backward through a
    frozen encoder whose input is data); the projector 3x. 0 without model.vision."""
    v = cfg.vision
    if v is None:
        return 0.0
    encoder, projector = encoder_forward_flops(v, cfg.hidden_size)
    return v.max_tiles * ((1.0 if v.freeze else 3.0) * encoder + 3.0 * projector) / seq_len


def cpu_peak_tflops(precision: str) -> float:
    """Rough whole-host CPU peak: cores x clock x FMA lanes (2 FMA units) x 2."""
    try:
        info = open("/proc/cpuinfo").read()
        mhz = float(re.search(r"cpu MHz\s*:\s*([\d.]+)", info).group(1))
        flags = re.search(r"flags\s*:(.*)", info).group(1).split()
    except (OSError, AttributeError):
        return float("nan")
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    if precision == "bf16" and "avx512_bf16" in flags:
        lanes *= 2
    return (os.cpu_count() or 1) * mhz * 1e6 * lanes * 2 * 2 / 1e12


def peak_tflops_per_device(device_kind: str, platform: str, precision: str, num_local_devices: int,
                           override: float | None = None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the figure came from)."""
    if override:
        return override, "train.peak_tflops"
    for name, table in PEAK_TFLOPS.items():
        if name in device_kind.upper().replace(" ", ""):
            return table.get(precision, table["bf16"]), f"{name} {precision} datasheet"
    if platform == "cpu":
        # Simulated CPU devices share the host's cores.
        return cpu_peak_tflops(precision) / max(num_local_devices, 1), "CPU estimate from /proc/cpuinfo"
    return float("nan"), f"unknown device kind {device_kind!r} (set train.peak_tflops)"
