"""Typed configuration tree.

A run is described by one `Config`: sections model, mesh, parallel, train,
precision, optim, data, checkpoint, logging, distributed, ops. It is built from YAML files (a file may
`include:` others, which it then overrides) and `key.sub=value` overrides,
in that order. Every key and value is checked against the dataclass types
here; mistakes raise `ConfigError` naming the key, the value and what is
accepted.

This module does not import JAX: the CLI reads the config before JAX starts
(e.g. to set a simulated CPU device count).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megajax.errors import ConfigError
from megajax.megatron_args import hint as megatron_hint

# Repository's configs/ directory (editable installs and source checkouts).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def user_cache_dir() -> Path:
    """megajax's cache directory (the embedded corpus, compiled programs): $MEGAJAX_CACHE, else
    $XDG_CACHE_HOME/megajax, else ~/.cache/megajax."""
    if os.environ.get("MEGAJAX_CACHE"):
        return Path(os.environ["MEGAJAX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megajax"


# ----------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------

FAMILY_DEFAULTS = {
    # GPT-2 / Megatron GPT: learned positions, LayerNorm, GELU, biases, tied embeddings.
    "gpt": dict(norm="layernorm", activation="gelu", position_embedding="learned",
                use_bias=True, tie_embeddings=True),
    # Llama 2/3: RoPE, RMSNorm, SwiGLU, no biases, untied output layer.
    "llama": dict(norm="rmsnorm", activation="swiglu", position_embedding="rope",
                  use_bias=False, tie_embeddings=False),
}


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "q_proj", "q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj",
                "in_proj", "out_proj", "experts")


@dataclass
class LoraConfig:
    """Low-rank adapters (model.lora; Megatron-Bridge's LoRA, PEFT's LoraConfig): each targeted linear
    y = x W becomes y = x W + (alpha / rank) dropout(x) A B with A [in, rank], B [rank, out] (zeros at
    the start), the base weights frozen. Targets (Megatron-Bridge's names, `linear_` prefix optional):
    qkv (the fused q/k/v projection: one A, one B over q, k and v), proj (attention output), fc1 (the
    MLP's first projection, gate and up together under SwiGLU: one A), fc2, multi-latent
    attention's q_proj, q_down_proj, q_up_proj, kv_down_proj, kv_up_proj (its output is proj), and a
    hybrid model's Mamba-2 mixers' in_proj (z, x, B, C and dt together: one A) and out_proj, and
    experts (a mixture of experts' routed experts: per expert, fc1 (gate and up: one A) and fc2)."""
    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])

    def target_names(self) -> tuple[str, ...]:
        return tuple(t[len("linear_"):] if t.startswith("linear_") else t for t in self.targets)


VISION_DEFAULTS = {
    # SigLIP (so400m and its kin): no class token, tanh-approximated GELU; LLaVA takes every patch.
    "siglip": dict(activation="gelu_tanh", feature_select="full", norm_eps=1e-6),
    # CLIP ViT (OpenAI's): a class token and a pre-layernorm, quick GELU; LLaVA drops the class token.
    "clip": dict(activation="quick_gelu", feature_select="default", norm_eps=1e-5),
}
# Each form's pixel normalisation (mean, std per RGB channel, after pixels / 255), as its checkpoints
# were trained: SigLIP's 0.5, OpenAI CLIP's own (megajax/inference/images.py; the LLaVA export's processor).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VISION_NORMALISATION = {"siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), "clip": (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)}


@dataclass
class VisionConfig:
    """The image encoder and projector of a vision-language model (model.vision; LLaVA, Megatron-Core's
    LLaVAModel): a ViT over image_size^2 pixels cut into patch_size^2 patches, whose patch embeddings
    (from layer `feature_layer`, Hugging Face's vision_feature_layer) a projector maps to the language
    model's width; they replace the `image_token_id` placeholders of the text, one per patch."""
    form: Literal["siglip", "clip"] = "siglip"
    image_size: int = 384
    patch_size: int = 14
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    ffn_hidden_size: int = 4304
    # None: the form's (VISION_DEFAULTS).
    activation: Literal["gelu", "gelu_tanh", "quick_gelu"] | None = None
    norm_eps: float | None = None
    # mlp: linear, GELU, linear (LLaVA's multi_modal_projector, Megatron's mlp); affine: one linear.
    projector: Literal["mlp", "affine"] = "mlp"
    image_token_id: int | None = None  # the placeholder token in the text (required)
    # The encoder layer whose output is taken (Hugging Face's vision_feature_layer: -1 the last, -2 the one
    # before; 0 the embeddings), and which of its tokens: default drops the class token (CLIP), full keeps all.
    feature_layer: int = -2
    feature_select: Literal["default", "full"] | None = None
    freeze: bool = False  # the encoder takes no gradient and no optimizer state (LLaVA's first stage)
    # Megatron's --pixel-shuffle (InternVL, NVLM): the features' patch grid [h, w, Dv] regrouped into
    # [h/2, w/2, 4 Dv], each 2 x 2 neighbourhood concatenated (top-left, top-right, bottom-left,
    # bottom-right): a quarter of the placeholders, a projector input 4x as wide. The grid side must be even.
    pixel_shuffle: bool = False
    # NVLM's and InternVL's dynamic tiling (Megatron's --use-tiling --max-num-tiles N): above 1, an image is
    # resized to the (columns, rows) grid of at most max_num_tiles image_size tiles closest to its aspect
    # ratio and cut into those tiles, each a picture to the encoder; its placeholders are every tile's
    # image_seq_length, tile after tile. use_thumbnail (--use-thumbnail) adds the whole image resized as a
    # last tile when there are several; tile_tags (--use-tile-tags) puts NVLM's text tags (<tile_1>, ...,
    # <tile_global_thumbnail> before the last tile) before each tile's placeholders.
    max_num_tiles: int = 1
    use_thumbnail: bool = False
    tile_tags: bool = False
    init_std: float = 0.02

    def resolve(self) -> None:
        for key, value in VISION_DEFAULTS[self.form].items():
            if getattr(self, key) is None:
                setattr(self, key, value)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def class_token(self) -> bool:
        return self.form == "clip"

    @property
    def image_seq_length(self) -> int:
        """Placeholders per image in the text (the one count every part uses): the patches (and a class
        token kept by feature_select=full), a quarter of the patches under pixel_shuffle."""
        if self.pixel_shuffle:
            return self.num_patches // 4
        return self.num_patches + (self.class_token and self.feature_select == "full")

    @property
    def feature_width(self) -> int:
        """The width of one image feature, the projector's input: hidden_size, 4x under pixel_shuffle."""
        return self.hidden_size * (4 if self.pixel_shuffle else 1)

    @property
    def tiled(self) -> bool:
        return self.max_num_tiles > 1

    @property
    def max_tiles(self) -> int:
        """Tiles one image may take (the loader's tile axis): max_num_tiles, plus the thumbnail."""
        return self.max_num_tiles + (self.tiled and self.use_thumbnail)

    def feature_layers(self) -> int:
        """Encoder layers run to reach the feature layer."""
        return self.feature_layer % (self.num_layers + 1)


@dataclass
class ModelConfig:
    family: Literal["gpt", "llama"] = "llama"
    num_layers: int | None = None  # None: hybrid_layer_pattern's layer count, else 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: = num_heads (no grouped-query attention)
    head_dim: int | None = None  # None: hidden_size // num_heads
    # Per-head RMSNorm of q and k (weights [head_dim], shared by the heads) after their projections,
    # before rope (Megatron's qk_layernorm; Qwen3's q_norm / k_norm). Its eps is norm_eps.
    qk_norm: bool = False
    ffn_hidden_size: int = 1024
    vocab_size: int | None = None  # None: the tokenizer's vocabulary
    make_vocab_size_divisible_by: int = 128  # padded to a multiple of this (mesh.tensor must divide it)
    max_position_embeddings: int | None = None  # None: train.seq_len
    # None: the family's default (FAMILY_DEFAULTS).
    norm: Literal["layernorm", "rmsnorm"] | None = None
    # squared_relu: relu(x)^2 of one projection (Megatron's --squared-relu; Nemotron-H's MLPs).
    # gelu is the exact (erf) GELU; gelu_tanh its tanh approximation, what Megatron-LM computes with its
    # default fused bias-GELU (bias_gelu_fusion, without --no-bias-gelu-fusion) and GPT-2's gelu_new.
    activation: Literal["gelu", "gelu_tanh", "swiglu", "squared_relu"] | None = None
    # none: no position information but the causal order (Megatron's position_embedding_type=none: the
    # attention layers of a Nemotron-H hybrid, whose Mamba layers carry the order).
    position_embedding: Literal["learned", "rope", "none"] | None = None
    use_bias: bool | None = None
    tie_embeddings: bool | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Literal["none", "llama3", "yarn"] = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # YaRN (rope_scaling=yarn; Megatron-Core's beta_fast, beta_slow, mscale, mscale_all_dim).
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    attention_impl: Literal["xla", "flash", "cudnn"] = "xla"  # plain jnp | Pallas kernel | cuDNN (GPU)
    # The FP8 products (train.precision=fp8): XLA's FP8 GEMM (cuBLASLt / hipBLASLt) | the Pallas kernel
    # pallas_kernels/fp8_matmul.py (interpret mode on CPU).
    matmul_impl: Literal["xla", "pallas"] = "xla"
    # Layers run as one scanned body (compile time independent of depth) or unrolled (no loop
    # bookkeeping: faster steps for shallow models, compile time grows with depth).
    scan_layers: bool = True
    # Mixture of experts (Megatron's names): 0 experts = a dense model.
    num_experts: int = 0
    moe_router_topk: int = 2  # experts per token
    moe_ffn_hidden_size: int | None = None  # each expert's hidden size; None: ffn_hidden_size
    # Every Nth layer is MoE (Megatron's integer form: layer i is MoE when i % N == 0), the others
    # dense MLPs of ffn_hidden_size; 1: all layers. Or Megatron's list form, one 0 (dense) or 1 (MoE)
    # per layer; accepted when the dense layers come first (DeepSeek-V3's [0]*3 + [1]*58).
    moe_layer_freq: int | list[int] = 1
    moe_aux_loss_coeff: float = 1e-2  # Switch/GShard load-balancing loss
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    moe_expert_capacity_factor: float | None = None  # None: dropless; else tokens per expert x this
    # The dropless experts' grouped products (Megatron's moe_grouped_gemm): jax.lax.ragged_dot (a
    # grouped GEMM on GPU/TPU) | tiled (rows padded per expert to 64-row tiles, a loop of batched
    # products: XLA:CPU, whose ragged_dot computes every group over all rows) | auto (tiled on CPU,
    # ragged_dot elsewhere). FP8 runs its own grouped product either way.
    moe_grouped_gemm_impl: Literal["auto", "ragged_dot", "tiled"] = "auto"
    # A dense MLP of this hidden size every token of a MoE layer also goes through, added to the routed
    # experts' output (Megatron's moe_shared_expert_intermediate_size, no gate); 0: none.
    moe_shared_expert_ffn_size: int = 0
    # Scales the shared expert's output by sigmoid(x . w) per token, w [hidden] learned (Megatron's
    # moe_shared_expert_gate, Qwen-MoE's shared_expert_gate).
    moe_shared_expert_gate: bool = False
    # Router scores: softmax over the top-k logits (Mixtral) | sigmoid of each logit (DeepSeek-V3).
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    # Softmax routing only: softmax over all experts, then the top-k of those probabilities, not
    # renormalised (Megatron's moe_router_pre_softmax; Qwen-MoE's norm_topk_prob=false). Off: the
    # top-k weights sum to 1 (softmax over the k logits, the same as renormalising the top-k).
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None  # multiplies the routing weights; None: 1
    # Group-limited routing (DeepSeek-V2/V3 device/node-limited): the experts form num_groups groups of
    # consecutive ids; each token picks its group_topk best groups (by the sum of each group's
    # topk / group_topk best scores), then its top-k experts within them. None: plain top-k.
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # Aux-loss-free balancing (DeepSeek-V3): > 0 gives each router a per-expert bias, added to the
    # scores for the top-k choice only and moved by this much per step toward balance (sigmoid only).
    moe_router_bias_update_rate: float = 0.0
    # Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's names, megajax/models/mla.py): q through
    # a q_lora_rank latent (None: a plain q projection), k/v through a kv_lora_rank latent, per-head
    # q/k of qk_head_dim without position + qk_pos_emb_head_dim rotary (one rope key shared by the
    # heads), v of v_head_dim. num_kv_heads must equal num_heads; head_dim is unused.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Multi-token prediction (DeepSeek-V3; Megatron-Core's names): this many extra blocks after the
    # model, block k predicting the token k + 1 places ahead from the previous depth's hidden state and
    # the next token's embedding, through the shared output layer; their mean cross entropy, times
    # mtp_loss_scaling_factor, is added to the objective (logged as `mtp_loss`). 0: none.
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # The kind of the depths' block: auto (the last decoder layer's kind, as Megatron-LM's training
    # script builds it: a mixture of experts for DeepSeek-V3), dense or moe.
    mtp_block: Literal["auto", "dense", "moe"] = "auto"
    # Hybrid models (Megatron-Core's hybrid model, Nemotron-H): one character per layer in Megatron's
    # syntax, M a Mamba-2 mixer, * attention, - an MLP, E a mixture of experts, | a pipeline-stage
    # boundary (megajax/models/mamba.py); each layer is a norm and that one mixer with its residual.
    # None: every layer is attention then MLP (a transformer).
    hybrid_layer_pattern: str | None = None
    # The Mamba-2 mixers (Megatron's names): state size N per group, head dim P, B/C groups, heads
    # (None: 2 x hidden_size / mamba_head_dim, Mamba's expand 2), the SSD's chunk length.
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None
    mamba_chunk_size: int = 128
    mamba_conv_kernel: int = 4  # the causal depthwise conv's width (Mamba's d_conv)
    # The SSD scan: the chunked form in plain jnp (XLA) | the Pallas kernels (pallas_kernels/ssd.py;
    # interpret mode on CPU).
    mamba_ssd_impl: Literal["xla", "pallas"] = "xla"
    # dt = softplus(dt_proj + dt_bias) clamped to [time_step_min, time_step_max] (Mamba-2's time_step_limit;
    # None: no upper limit); dt_bias is initialised from dt drawn log-uniformly in [dt_min, dt_max].
    mamba_time_step_min: float = 0.0
    mamba_time_step_max: float | None = None
    mamba_dt_min: float = 0.001
    mamba_dt_max: float = 0.1
    # Low-rank adapters on the named linears, the rest of the model frozen (LoraConfig): a vision-language
    # model's adapters are its language model's, its projector trains beside them (and its encoder unless
    # model.vision.freeze; megajax/models/trainable.py). None: none.
    lora: LoraConfig | None = None
    # A vision-language model: the image encoder and projector in front of this language model
    # (VisionConfig); None: text only.
    vision: VisionConfig | None = None
    # The language model (embeddings, layers, output) takes no gradient and no optimizer state.
    freeze_language_model: bool = False

    def resolve(self, seq_len: int) -> None:
        if self.vision is not None:
            self.vision.resolve()
        if self.num_layers is None:
            self.num_layers = len(self.hybrid_pattern()) if self.hybrid_layer_pattern else 4
        for key in ("num_heads", "hidden_size", "mamba_head_dim"):  # divisors below: checked before the division
            _positive(f"model.{key}", getattr(self, key))
        if self.hybrid_layer_pattern and self.mamba_num_heads is None and "M" in self.hybrid_layer_pattern:
            if (2 * self.hidden_size) % self.mamba_head_dim:
                raise ConfigError(
                    f"model.mamba_head_dim={self.mamba_head_dim} does not divide 2 x model.hidden_size="
                    f"{2 * self.hidden_size} (the Mamba mixers' inner size); set model.mamba_num_heads explicitly "
                    f"or change one of them.")
            self.mamba_num_heads = 2 * self.hidden_size // self.mamba_head_dim
        for key, value in FAMILY_DEFAULTS[self.family].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads="
                    f"{self.num_heads}; set model.head_dim explicitly or change one of them.")
            self.head_dim = self.hidden_size // self.num_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = seq_len
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size

    def uses_dropout(self) -> bool:
        """Whether training draws dropout masks (hidden, attention or the adapters' input dropout)."""
        return self.hidden_dropout > 0 or self.attention_dropout > 0 or (
            self.lora is not None and self.lora.dropout > 0)

    def hybrid_pattern(self) -> str:
        """hybrid_layer_pattern without its stage boundaries: one character per layer ('' when unset)."""
        return (self.hybrid_layer_pattern or "").replace("|", "")

    def hybrid_group(self) -> str:
        """The shortest run of layers the hybrid pattern repeats (the whole pattern when it does not
        repeat): the unit its layers are stacked and scanned in, and split over pipeline stages."""
        pattern = self.hybrid_pattern()
        n = len(pattern)
        return next(pattern[:p] for p in range(1, n + 1) if n % p == 0 and pattern[:p] * (n // p) == pattern)

    def attention_layers(self) -> int:
        """Layers with attention: a hybrid pattern's `*` layers, every layer of a transformer (its
        multi-token prediction layers not counted)."""
        return self.hybrid_pattern().count("*") if self.hybrid_layer_pattern else self.num_layers

    def mamba_layers(self) -> int:
        """A hybrid pattern's Mamba (`M`) layers; 0 for a transformer."""
        return self.hybrid_pattern().count("M")

    def mamba_inner_size(self) -> int:
        """A Mamba mixer's inner width (Megatron's d_inner): heads x head dim."""
        return (self.mamba_num_heads or 0) * self.mamba_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether model layer `layer` (from 0) has a mixture of experts (Megatron's pattern)."""
        if self.hybrid_layer_pattern:
            return bool(self.num_experts) and self.hybrid_pattern()[layer] == "E"
        if isinstance(self.moe_layer_freq, list):
            return bool(self.num_experts) and bool(self.moe_layer_freq[layer])
        return bool(self.num_experts) and layer % self.moe_layer_freq == 0

    def dense_first_layers(self) -> int:
        """The dense layers before the first MoE layer of a model whose moe_layer_freq is the list
        form (they are a second stack, `dense_layers`, megajax/models/layout.py); 0 otherwise."""
        if not self.num_experts or not isinstance(self.moe_layer_freq, list):
            return 0
        return self.num_layers - sum(self.moe_layer_freq)

    def num_moe_layers(self) -> int:
        """The layers with a mixture of experts (0 for a dense model)."""
        return sum(map(self.is_moe_layer, range(self.num_layers)))

    def mtp_moe(self) -> bool:
        """Whether the multi-token prediction depths' block is a mixture of experts (mtp_block; auto:
        like the last decoder layer)."""
        if not self.mtp_num_layers or not self.num_experts:
            return False
        return self.mtp_block == "moe" or (self.mtp_block == "auto" and self.is_moe_layer(self.num_layers - 1))

    def num_router_layers(self) -> int:
        """The blocks with a router: the MoE layers, then the MoE multi-token prediction depths (the
        rows of the routers' expert bias and statistics, in that order)."""
        return self.num_moe_layers() + (self.mtp_num_layers if self.mtp_moe() else 0)

    def interleaves_dense_layers(self) -> bool:
        """A MoE model whose MoE layers alternate with dense ones (moe_layer_freq > 1): its dense
        blocks are a second stack, `dense_layers` (megajax/models/layout.py)."""
        return bool(self.num_experts) and not isinstance(self.moe_layer_freq, list) and self.moe_layer_freq > 1

    def padded_vocab_size(self) -> int:
        """The vocabulary padded to a multiple of make_vocab_size_divisible_by (128).

        Independent of the mesh, so a checkpoint's shapes depend on the model alone: every
        tensor size that divides the multiple (1, 2, 4, ..., 128 for the default) divides it,
        and restoring onto another tensor size is a plain read. (Megatron pads to a multiple of
        128 x tensor size; its exports get that padding, megatron_padded_vocab_size.)"""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    def megatron_padded_vocab_size(self, tensor: int) -> int:
        """Megatron-LM's padding: a multiple of make_vocab_size_divisible_by x tensor size."""
        multiple = self.make_vocab_size_divisible_by * tensor
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class AxisSizes:
    """One size per mesh axis. Its fields are the mesh axes, outermost to innermost (MESH_AXES)."""
    pipeline: int = 1
    data: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1


MESH_AXES = tuple(f.name for f in dataclasses.fields(AxisSizes))


@dataclass
class DcnConfig(AxisSizes):
    """Inter-node (data-centre network) factor of each mesh axis, for multi-host meshes."""


@dataclass
class MeshConfig(AxisSizes):
    """Mesh axis sizes (per slice/node when `dcn` is set); one may be -1 to take the remaining devices."""
    data: int = -1  # (keeps its place among the axes)
    dcn: DcnConfig = field(default_factory=DcnConfig)
    # Number of simulated CPU devices to create when running on CPU (0: leave as is).
    # Ignored when the caller already set --xla_force_host_platform_device_count.
    cpu_devices: int = 0


@dataclass
class ParallelConfig:
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # ZeRO-1: optimizer state sharded over data axes
    recompute: Literal["none", "selective", "full"] = "none"
    context_impl: Literal["ring", "allgather"] = "ring"  # attention across mesh.context
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved"] = "1f1b"  # with mesh.pipeline > 1
    virtual_stages: int = 1  # model chunks per pipeline stage (interleaved schedule)
    # A vision-language model's encoder and projector split over this many of mesh.tensor's devices
    # (Megatron's --encoder-tensor-model-parallel-size): 0 the language model's (mesh.tensor), 1 whole
    # on every tensor rank.
    encoder_tensor_parallel: int = 0
    # MoE token exchange over mesh.expert: fixed-size all_to_all buffers (every backend) | ragged
    # (jax.lax.ragged_all_to_all: only the real rows move; GPU/TPU, dropless routing only).
    moe_all_to_all: Literal["padded", "ragged"] = "padded"
    # Dropless MoE dispatch over mesh.expert (Megatron's --moe-token-dispatcher-type): alltoall (the
    # assignments to their experts' devices and back) | allgather (the expert group's tokens on every
    # device, partial sums reduce-scattered) | auto (allgather on CPU with padded buffers, else alltoall).
    moe_token_dispatcher: Literal["auto", "alltoall", "allgather"] = "auto"
    # The routed experts' own tensor size (Megatron's --expert-tensor-parallel-size): None or the tensor
    # size (mesh.tensor x mesh.dcn.tensor) splits each expert's hidden dim over `tensor` like the dense
    # MLP; 1 folds the tensor and context devices into expert parallelism for the experts (Megatron's
    # MoE parallel folding): the experts split over expert x context x tensor, each expert whole.
    expert_tensor_parallel: int | None = None
    # Tensor-parallel collectives overlapped with the products on GPUs (Megatron's --tp-comm-overlap):
    # with tensor parallelism on a GPU, the sequence-parallel products run as collective matmuls (each
    # step's transfer beside the previous step's partial product, megajax/parallel/tensor.py) and XLA's
    # scheduler options that overlap them are set (megajax/xla_env.py); false: neither.
    tp_comm_overlap: bool = True


@dataclass
class TrainConfig:
    steps: int = 200
    seed: int = 0
    seq_len: int = 256
    global_batch: int = 8
    micro_batch: int | None = None  # per data-parallel rank; None: no accumulation
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    run_dir: str = ""  # empty: runs/<date>-<time>
    log_every: int = 10
    skip_nonfinite: bool = False  # skip a step with non-finite loss/grads instead of stopping
    max_skipped_steps: int = 10  # stop after more consecutive skipped steps than this (divergence)
    # fp16 dynamic loss scaling (Megatron's defaults).
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    eval_every: int = 100  # validation pass every N steps (0: never)
    eval_steps: int = 5  # global batches per validation pass
    peak_tflops: float | None = None  # per device; None: from the device table
    device_memory_gib: float | None = None  # per-device capacity for the fit check; None: from the device
    # The sample printed after training: up to sample_tokens new tokens (0: none) after sample_prompt
    # ("": the first whole lines of a held-out document, else "def "), drawn with this temperature (0:
    # greedy) and top-p, seeded by train.seed.
    sample_tokens: int = 160
    sample_prompt: str = ""
    sample_temperature: float = 0.8
    sample_top_p: float = 0.95
    # Exact-match accuracy of greedy answers to this many held-out prompts (0: off), printed before the
    # first step and after the last: the conversations of exact_match_path (jsonl, each ending with the
    # expected assistant answer; empty: the generated instruction tasks' held-out split).
    exact_match_prompts: int = 0
    exact_match_path: str = ""


# The FP8 products by name (precision.fp8_bf16_products names those kept in bf16): attention's fused
# q/k/v (multi-latent attention's q/kv projections too) and output projections, the MLPs' fc1 and fc2
# (shared experts' included), the routed experts' products, a Mamba-2 mixer's in_proj (z, x, B, C),
# its dt projection and out_proj, and a multi-token prediction depth's projection.
FP8_PRODUCT_NAMES = ("qkv", "out_projection", "fc1", "fc2", "experts", "mamba_in_proj", "mamba_dt",
                     "mamba_out_proj", "mtp_projection")


@dataclass
class PrecisionConfig:
    """The parameters' dtype, and FP8 training (train.precision=fp8): how the linear layers' products
    are scaled.

    Transformer Engine's per-tensor recipes: `delayed` scales each tensor of each product by
    fp8_max / max(amax history) / 2^margin, the history holding the last
    `fp8_amax_history_len` steps' amaxes (this step's included in the next step's scale);
    `current` (Megatron's name: `tensorwise`) scales each tensor by its own amax where it is
    quantized. The block-scaled recipes scale every block by its own amax, e4m3 throughout:
    `blockwise` (DeepSeek-V3's: 1 x 128 blocks of activations and gradients, 128 x 128 tiles of
    weights, power-of-two scales) and `mxfp8` (OCP MX: 32-element blocks, e8m0 scales)."""
    # The dtype the train state holds the parameters in: `compute` (train.precision's compute dtype:
    # bf16 for bf16 and fp8, fp16 for fp16) with an fp32 master copy in the optimizer state, split as
    # the Adam moments are (Megatron's --bf16/--fp16: 16-bit model params, fp32 main params), or `fp32`
    # (fp32 parameters and no copy: MaxText's weight_dtype float32). fp32 runs hold fp32 either way.
    param_dtype: Literal["compute", "fp32"] = "compute"
    fp8_recipe: Literal["delayed", "current", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    fp8_amax_history_len: int = 1024
    fp8_margin: int = 0
    # The output layer (logits) in FP8 too; off: bf16, as Megatron keeps it. (The embedding is a
    # row lookup, not a product: always in the compute dtype.)
    fp8_output_layer: bool = False
    # The FP8 products kept in bf16 (names from FP8_PRODUCT_NAMES): by default a Mamba-2 mixer's dt
    # projection and out_proj, as Nemotron-H's FP8 recipe keeps them.
    fp8_bf16_products: list = field(default_factory=lambda: ["mamba_dt", "mamba_out_proj"])
    # FSDP gathers the FP8 products' weights as their float8 copies (quantized on each device's
    # shard: one byte a value instead of two), where XLA partitions the products; the parameters and
    # the optimizer's fp32 master copy are unchanged (Megatron's --fp8-param-gather).
    fp8_param_gather: bool = False


@dataclass
class OptimConfig:
    # lr, weight_decay and warmup_steps left unset with checkpoint.load of a released model take fine-tuning's
    # values instead (megajax/checkpoint/stored_model.py FINE_TUNING_OPTIM)
    lr: float = 2e-3
    min_lr: float | None = None  # None: lr / 10
    warmup_steps: int = 20
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: int | None = None  # None: train.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # global-norm clipping (0: off)


@dataclass
class DataConfig:
    # Megatron dataset prefix, or [weight, prefix, weight, prefix, ...]; empty: the
    # embedded corpus (this Python's standard library sources). With format chat: a jsonl
    # file or a directory of *.jsonl (or a weighted list of them).
    path: Union[str, list] = ""
    # gpt: Megatron .bin/.idx documents; chat: jsonl conversations rendered with the tokenizer's
    # chat template (megajax/data/chat.py; Megatron's --sft); webdataset: tar shards of images and
    # their captions or conversations for model.vision (megajax/data/webdataset.py; path empty: the
    # embedded drawn shapes, megajax/data/shapes.py).
    format: Literal["gpt", "chat", "webdataset"] = "gpt"
    loss_on: Literal["assistant", "all"] = "assistant"  # chat: train on the answers only, or on every token
    packing: bool = True  # chat: pack conversations into rows (else one conversation per row)
    split: str = "969,30,1"  # train, validation, test shares of the documents
    tokenizer: str = "byte"  # 'byte' or a Hugging Face tokenizer.json (file or directory)
    cache_dir: str = ""  # sample-index cache; empty: <dataset dir>/cache/GPTDataset_indices
    # Document-aware batches (Megatron's flags of the same names).
    reset_position_ids: bool = False
    reset_attention_mask: bool = False  # attention does not cross end-of-document tokens
    eod_mask_loss: bool = False  # no loss on predictions made from an end-of-document token
    prefetch: int = 2  # batches prepared ahead in a background thread
    num_workers: int = 4  # webdataset: threads decoding a batch's images (Megatron's --num-workers)
    strict: bool = False  # webdataset: a damaged or unpaired sample is an error (else skipped and counted)
    corpus_max_mb: float = 8.0  # size cap of the embedded corpus


@dataclass
class CheckpointConfig:
    """Checkpoints live in <train.run_dir>/checkpoints; a run restarted there resumes from the latest."""
    every: int = 0  # save every N steps (0: only at the end and on SIGTERM/SIGINT)
    keep: int = 3  # most recent checkpoints kept
    async_save: bool = True  # write in the background while training continues
    load: str = ""  # start from these parameters (a run/checkpoint directory), optimizer state fresh
    # Resume (or load, export, generate, serve) this step instead of the latest (Megatron's --ckpt-step).
    step: int | None = None
    # Read a checkpoint saved with another vocabulary (tokenizer or model.vocab_size): crop or
    # zero-pad its embedding and output rows (and, on resume, their optimizer state). Off: refused.
    resize_vocab: bool = False
    # checkpoint.load of a Megatron checkpoint: unpickle its files fully (they can run any code they name),
    # for a checkpoint you trust that the restricted reader refuses (megajax import's --trust-checkpoint).
    trust_load: bool = False


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress: bool | None = None  # progress bar with ETA; None: when stderr is a terminal


@dataclass
class DistributedConfig:
    """Several processes (one per node, or one per GPU) forming one JAX runtime; see megajax/distributed.py.

    Empty values come from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID, JAX_LOCAL_DEVICE_IDS) or are detected from the scheduler (SLURM, Open MPI,
    Kubernetes indexed Jobs). With none of these a run is a single process."""
    coordinator_address: str = ""  # host:port of process 0's coordinator service
    coordinator_port: int | None = None  # port used with a detected coordinator host (None: scheduler default)
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: list | None = None  # accelerators this process drives; None: all on its node
    cluster: Literal["auto", "slurm", "ompi", "k8s", "none"] = "auto"  # scheduler to detect ("none": no detection)
    initialization_timeout: int = 300  # seconds for all processes to join
    heartbeat_timeout: int = 100  # seconds without heartbeats after which a process counts as dead


@dataclass
class OpsConfig:
    """Operations: hang watchdog, Prometheus metrics, profiler traces (megajax/train/ops.py)."""
    # A step is a hang when it runs longer than max(hang_factor x median step time, hang_timeout)
    # (a 0 drops its term; both 0: no watchdog); the process then writes every thread's stack to
    # <run_dir>/logs/hang_process_<i>.txt and exits with status 3.
    hang_factor: float = 20.0
    hang_timeout: float = 600.0  # seconds
    prometheus_port: int = 0  # serve metrics at http://<process 0>:port/metrics (0: off)
    profile_steps: list | None = None  # [first, last]: a JAX profiler trace of these steps in <run_dir>/profile
    # JAX's persistent compilation cache (megajax/compile_cache.py): true: <megajax cache dir>/jax (see
    # user_cache_dir; $JAX_COMPILATION_CACHE_DIR wins when set); a directory; false or "": off.
    compile_cache: Union[bool, str] = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------
# Typed construction from nested dicts
# ----------------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            list: "a list"}.get(tp, getattr(tp, "__name__", str(tp)))


_NO_MATCH = object()


def _coerce(value: Any, tp: Any) -> Any:
    """Returns value converted to tp, or _NO_MATCH."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value if value in typing.get_args(tp) else _NO_MATCH
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            out = _coerce(value, arg)
            if out is not _NO_MATCH:
                return out
        return _NO_MATCH
    if tp is type(None):
        return None if value is None else _NO_MATCH
    if tp is bool:
        return value if isinstance(value, bool) else _NO_MATCH
    if tp is int:
        if isinstance(value, bool):
            return _NO_MATCH
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return _NO_MATCH
    if tp is float:
        if isinstance(value, bool):
            return _NO_MATCH
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                return _NO_MATCH
        return _NO_MATCH
    if tp is str:
        return value if isinstance(value, str) else _NO_MATCH
    if tp is list or origin is list:
        return list(value) if isinstance(value, (list, tuple)) else _NO_MATCH
    return _NO_MATCH


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix or '<root>'} = {data!r}: expected a mapping of "
                          f"{', '.join(f.name for f in dataclasses.fields(cls))}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f"{prefix}." if prefix else ""
            megatron = megatron_hint(str(key))
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; {megatron}." if megatron else f"; did you mean {where}{close[0]}?" if close else ""
            raise ConfigError(f"config key {where}{key}: unknown key{hint} "
                              f"Accepted keys{' in ' + prefix if prefix else ''}: {', '.join(names)}.")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        key = f"{prefix}.{name}" if prefix else name
        value = data[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
            continue
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if inner and typing.get_origin(tp) in (Union, types.UnionType):  # an optional section (model.lora, model.vision)
            kwargs[name] = None if value is None else _build(inner[0], value, key)
            continue
        out = _coerce(value, tp)
        if out is _NO_MATCH:
            raise ConfigError(f"config key {key} = {value!r}: expected {_type_name(tp)}.")
        kwargs[name] = out
    return cls(**kwargs)


# ----------------------------------------------------------------------------
# Files and overrides
# ----------------------------------------------------------------------------

def resolve_config_path(name: str, relative_to: Path | None = None) -> Path:
    """A config file by path, or by name under configs/ (e.g. `model/llama3-8b`, `tiny`)."""
    candidates = []
    raw = Path(name)
    for base in ([relative_to] if relative_to else []) + [Path.cwd(), CONFIG_DIR]:
        candidates += [base / raw, base / f"{name}.yaml"]
    candidates += sorted(CONFIG_DIR.glob(f"*/{name}.yaml")) + sorted(CONFIG_DIR.glob(f"*/{name}"))
    for c in candidates:
        if c.is_file():
            return c
    known = sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.glob("*/*.yaml"))
    raise ConfigError(f"config file {name!r} not found (looked relative to "
                      f"{relative_to or Path.cwd()} and in {CONFIG_DIR}). Shipped configs: {', '.join(known)}.")


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """Reads a config file, applying its `include:` list (included files first, this file on top)."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"config file {path} includes itself (include chain: "
                          f"{' -> '.join(str(p) for p in _seen + (path,))}).")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: cannot read it as YAML text ({e}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}.")
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) and i for i in includes):
        raise ConfigError(f"config file {path}: include = {includes!r}: expected a file name or a list of them "
                          f"(paths relative to the file, or names under configs/ such as model/llama3-8b).")
    merged: dict = {}
    for inc in includes:
        merged = _deep_merge(merged, load_yaml(resolve_config_path(inc, path.parent), _seen + (path,)))
    return _deep_merge(merged, data)


def parse_override(text: str) -> dict:
    """`train.steps=10` -> {'train': {'steps': 10}} (the value is read as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value (e.g. train.steps=100).")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: the key must be dotted names such as train.steps.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    out: dict = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def merge_sources(files: list[str] | None = None, overrides: list[str] | None = None,
                  base: dict | None = None) -> dict:
    """The config tree as set: `base`, then files, then overrides (later wins); nothing filled in."""
    merged: dict = dict(base or {})
    for f in files or []:
        merged = _deep_merge(merged, load_yaml(resolve_config_path(f)))
    for o in overrides or []:
        merged = _deep_merge(merged, parse_override(o))
    return merged


def load_config(files: list[str] | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Config:
    """Builds, resolves and validates a Config from files, then overrides (later wins)."""
    cfg = _build(Config, merge_sources(files, overrides, base), "")
    finalize(cfg)
    return cfg


def finalize(cfg: Config) -> Config:
    """Fills derived values and checks combinations that need no devices."""
    cfg.model.resolve(cfg.train.seq_len)
    if cfg.optim.min_lr is None:
        cfg.optim.min_lr = cfg.optim.lr / 10
    validate(cfg)
    return cfg


def parse_split(split: str) -> list[float]:
    """"969,30,1" -> normalised train/valid/test fractions [3] (missing trailing parts are 0): the syntax of
    data.split (megajax/data/gpt_dataset.py cuts the documents by these fractions)."""
    parts = [p for p in re.split(r"[,/\s]+", str(split).strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not v >= 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"data split = {split!r}: expected one to three non-negative weights for "
                          f"train,valid,test with a positive sum, e.g. '969,30,1' or '98,2'.")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def _positive(key: str, value: int | float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        finite = "a finite number " if isinstance(value, float) else ""
        raise ConfigError(f"config key {key} = {value}: must be {finite}{'>= 0' if allow_zero else '> 0'}.")


def validate_ranges(cfg: Config) -> None:
    """The numbers no other check reads before they are used: seeds, loss scaling, optimizer constants,
    model constants (each a ConfigError naming the key, the value and the range)."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"config key train.seed = {t.seed}: must be in [0, 2^32) (the data order is drawn with "
                          f"numpy's RandomState, as Megatron's is).")
    for key in ("initial_loss_scale", "min_loss_scale", "peak_tflops", "device_memory_gib"):
        _positive(f"train.{key}", getattr(t, key))
    if t.min_loss_scale > t.initial_loss_scale:
        raise ConfigError(f"train.min_loss_scale = {t.min_loss_scale:g} is above train.initial_loss_scale = "
                          f"{t.initial_loss_scale:g}; the loss scale starts at the initial one and never drops "
                          f"below the minimum.")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"config key optim.{key} = {getattr(o, key)}: must be in [0, 1).")
    _positive("optim.eps", o.eps)
    for key in ("norm_eps", "rope_theta", "rope_scaling_factor", "init_std", "moe_router_topk_scaling_factor"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "mtp_loss_scaling_factor", "moe_router_bias_update_rate"):
        _positive(f"model.{key}", getattr(m, key), allow_zero=True)
    _positive("data.corpus_max_mb", cfg.data.corpus_max_mb)


def validate_model_sizes(m: ModelConfig) -> None:
    """The model's sizes, resolved: each > 0, whole query groups, an even rotary head (a model read from
    another program's config is checked by these too)."""
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                "ffn_hidden_size", "vocab_size", "max_position_embeddings", "make_vocab_size_divisible_by"):
        _positive(f"model.{key}", getattr(m, key))
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads="
                          f"{m.num_kv_heads}; grouped-query attention needs whole groups.")
    if m.position_embedding == "rope" and m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even for rotary position embeddings.")


def validate(cfg: Config) -> None:
    m, t, o = cfg.model, cfg.train, cfg.optim
    validate_model_sizes(m)
    if m.qk_norm and m.norm != "rmsnorm":
        raise ConfigError(f"model.qk_norm = true with model.norm = {m.norm!r}: the q/k norms are RMSNorms, like "
                          f"the model's other norms in Megatron's qk_layernorm. Set model.norm=rmsnorm or "
                          f"model.qk_norm=false.")
    for key in ("steps", "seq_len", "global_batch", "micro_batch", "log_every", "loss_scale_window",
                "hysteresis", "max_skipped_steps"):
        _positive(f"train.{key}", getattr(t, key))
    _positive("train.sample_tokens", t.sample_tokens, allow_zero=True)
    _positive("train.exact_match_prompts", t.exact_match_prompts, allow_zero=True)
    if not 0.0 <= t.sample_temperature < float("inf"):
        raise ConfigError(f"train.sample_temperature = {t.sample_temperature}: must be a finite number >= 0 "
                          f"(0 samples greedily).")
    if not 0.0 < t.sample_top_p <= 1.0:
        raise ConfigError(f"train.sample_top_p = {t.sample_top_p}: must be in (0, 1] (1 keeps every token).")
    _positive("train.eval_every", t.eval_every, allow_zero=True)
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("checkpoint.step", cfg.checkpoint.step, allow_zero=True)
    _positive("train.eval_steps", t.eval_steps)
    _positive("data.prefetch", cfg.data.prefetch, allow_zero=True)
    try:
        parse_split(cfg.data.split)
    except ConfigError as e:
        raise ConfigError(str(e).replace("data split", "config key data.split", 1)) from None
    _positive("optim.lr", o.lr)
    _positive("optim.min_lr", o.min_lr, allow_zero=True)
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    _positive("optim.clip_grad", o.clip_grad, allow_zero=True)
    _positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive("optim.decay_steps", o.decay_steps)
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} is larger than optim.lr={o.lr}; min_lr must be <= lr.")
    for key in ("hidden_dropout", "attention_dropout"):
        p = getattr(m, key)
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"config key model.{key} = {p}: must be in [0, 1).")
    if m.position_embedding == "learned" and m.max_position_embeddings < t.seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings="
                          f"{m.max_position_embeddings} of the learned position table; lower "
                          f"train.seq_len or raise model.max_position_embeddings.")
    validate_precision(cfg)
    validate_ranges(cfg)
    validate_lora(m)
    for axis in MESH_AXES:
        size = getattr(cfg.mesh, axis)
        if size == 0 or size < -1:
            raise ConfigError(f"config key mesh.{axis} = {size}: must be a positive size or -1 "
                              f"(take the remaining devices).")
        _positive(f"mesh.dcn.{axis}", getattr(cfg.mesh.dcn, axis))
    if sum(getattr(cfg.mesh, a) == -1 for a in MESH_AXES) > 1:
        raise ConfigError("at most one mesh axis may be -1; got "
                          + ", ".join(f"mesh.{a}=-1" for a in MESH_AXES if getattr(cfg.mesh, a) == -1) + ".")
    _positive("mesh.cpu_devices", cfg.mesh.cpu_devices, allow_zero=True)
    _positive("parallel.virtual_stages", cfg.parallel.virtual_stages)
    _positive("parallel.encoder_tensor_parallel", cfg.parallel.encoder_tensor_parallel, allow_zero=True)
    if cfg.parallel.virtual_stages != 1 and cfg.parallel.pipeline_schedule != "interleaved":
        raise ConfigError(f"parallel.virtual_stages = {cfg.parallel.virtual_stages} needs "
                          f"parallel.pipeline_schedule=interleaved (this config has "
                          f"{cfg.parallel.pipeline_schedule!r}); set virtual_stages=1 or use the interleaved schedule.")
    validate_moe(cfg)
    validate_mla(cfg)
    validate_mtp(cfg)
    validate_hybrid(cfg)
    validate_yarn(cfg)
    validate_vision(cfg)
    if m.attention_impl != "xla" and m.attention_dropout:
        raise ConfigError(f"model.attention_dropout = {m.attention_dropout} needs model.attention_impl=xla; "
                          f"the {m.attention_impl} kernel has no dropout (set attention_dropout=0).")
    validate_distributed_and_ops(cfg)
    context = cfg.mesh.context * cfg.mesh.dcn.context
    if context != 1:
        if m.attention_dropout:
            raise ConfigError(f"model.attention_dropout = {m.attention_dropout} with mesh.context = "
                              f"{cfg.mesh.context}: context-parallel attention has no dropout; set it to 0.")


def validate_lora(m: ModelConfig) -> None:
    """model.lora: a positive rank and alpha, dropout in [0, 1), and targets the model has."""
    lo = m.lora
    if lo is None:
        return
    _positive("model.lora.rank", lo.rank)
    _positive("model.lora.alpha", lo.alpha)
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"config key model.lora.dropout = {lo.dropout}: must be in [0, 1).")
    mla = m.multi_latent_attention
    has = {"proj"} | ({"q_down_proj", "q_up_proj"} if mla and m.q_lora_rank is not None else
                      {"q_proj"} if mla else set()) | ({"kv_down_proj", "kv_up_proj"} if mla else {"qkv"})
    has |= {"fc1", "fc2"} | ({"experts"} if m.num_experts else set())  # the dense MLPs' (and shared experts')
    if m.hybrid_layer_pattern:  # the linears of the layers the pattern has
        kinds = set(m.hybrid_layer_pattern)
        has = (({"qkv", "proj"} if "*" in kinds else set()) | ({"in_proj", "out_proj"} if "M" in kinds else set())
               | ({"fc1", "fc2"} if "-" in kinds or ("E" in kinds and m.moe_shared_expert_ffn_size) else set())
               | ({"experts"} if "E" in kinds else set()))
    bad = [t for t in lo.target_names() if t not in has]
    if not lo.targets or bad or len(set(lo.target_names())) != len(lo.targets):
        raise ConfigError(f"config key model.lora.targets = {lo.targets}: "
                          f"{'unknown or repeated targets ' + str(bad or lo.targets) if lo.targets else 'empty'}; "
                          f"this model's linears are {', '.join(t for t in LORA_TARGETS if t in has)} "
                          f"(Megatron-Bridge's names, the `linear_` prefix optional).")
    if mla and lo.dropout > 0:
        raise ConfigError(f"model.lora.dropout = {lo.dropout} with model.multi_latent_attention: its adapters take "
                          f"no input dropout; set model.lora.dropout=0.")
    if "experts" in lo.target_names() and lo.dropout > 0:
        raise ConfigError(f"model.lora.dropout = {lo.dropout} with the `experts` target: the experts' adapters are "
                          f"merged into their kernels in the step and take no input dropout; set model.lora.dropout=0 "
                          f"or drop `experts` from model.lora.targets.")


def validate_vision(cfg: Config) -> None:
    """model.vision: positive sizes, an image that the patches tile, heads that divide the width, a
    placeholder token inside the vocabulary, a feature layer the encoder has."""
    m = cfg.model
    v = m.vision
    _positive("data.num_workers", cfg.data.num_workers)
    if v is None and cfg.data.format == "webdataset":
        raise ConfigError("data.format = 'webdataset' (image-text shards) needs model.vision, a vision-language "
                          "model (e.g. --config model/tiny-llava); this model reads text only. Use data.format=gpt "
                          "or chat for text.")
    if v is None:
        if m.freeze_language_model:
            raise ConfigError("model.freeze_language_model = true without model.vision: nothing would train; "
                              "set model.vision or drop freeze_language_model.")
        return
    if m.lora is not None and m.freeze_language_model:
        raise ConfigError("model.lora with model.freeze_language_model = true: the adapters are the language model's, "
                          "so they would not train; drop one of them (with model.lora the language model's base "
                          "weights are frozen anyway).")
    for key in ("image_size", "patch_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                "norm_eps", "init_std"):
        _positive(f"model.vision.{key}", getattr(v, key))
    if v.patch_size > v.image_size:
        raise ConfigError(f"model.vision.patch_size={v.patch_size} is larger than model.vision.image_size="
                          f"{v.image_size}: the image holds no patch. (An image_size that patch_size does not divide "
                          f"loses its last image_size % patch_size rows and columns, as the patch convolution does: "
                          f"SigLIP's 384 / 14 gives 27 x 27 patches.)")
    if v.hidden_size % v.num_heads:
        raise ConfigError(f"model.vision.hidden_size={v.hidden_size} is not divisible by model.vision.num_heads="
                          f"{v.num_heads}.")
    if v.image_token_id is None:
        raise ConfigError("model.vision.image_token_id is not set: the text's image placeholder token is required "
                          "(Hugging Face's image_token_id, e.g. the tokenizer's <image>).")
    if m.vocab_size is not None and not 0 <= v.image_token_id < m.vocab_size:
        raise ConfigError(f"model.vision.image_token_id={v.image_token_id} is outside the vocabulary [0, "
                          f"{m.vocab_size}) (model.vocab_size).")
    if not -v.num_layers - 1 <= v.feature_layer <= v.num_layers:
        raise ConfigError(f"model.vision.feature_layer={v.feature_layer}: the encoder has {v.num_layers} layers; "
                          f"accepted: {-v.num_layers - 1} to {v.num_layers} (-1 the last layer, 0 the embeddings).")
    if v.feature_select == "default" and not v.class_token:
        raise ConfigError(f"model.vision.feature_select = default drops the class token, which the {v.form} form "
                          f"has not; use feature_select=full (or form=clip).")
    if v.pixel_shuffle:
        side = v.image_size // v.patch_size
        if side % 2:
            raise ConfigError(f"model.vision.pixel_shuffle = true needs an even patch grid side, but "
                              f"model.vision.image_size={v.image_size} // model.vision.patch_size={v.patch_size} = "
                              f"{side}; accepted: image_size // patch_size a multiple of 2.")
        if v.class_token and v.feature_select == "full":
            raise ConfigError("model.vision.pixel_shuffle = true regroups the patch grid, which a kept class token "
                              "is not part of; with form=clip use feature_select=default (drops the class token).")
    _positive("model.vision.max_num_tiles", v.max_num_tiles)
    for key, what in (("use_thumbnail", "add a thumbnail to"), ("tile_tags", "tag")):
        if getattr(v, key) and not v.tiled:
            raise ConfigError(f"model.vision.{key} = true with model.vision.max_num_tiles = {v.max_num_tiles}: "
                              f"an untiled image has no tiles to {what}; "
                              f"set max_num_tiles above 1 (Megatron's --use-tiling --max-num-tiles N) or drop {key}.")


def validate_precision(cfg: Config) -> None:
    p, t = cfg.precision, cfg.train
    _positive("precision.fp8_amax_history_len", p.fp8_amax_history_len)
    _positive("precision.fp8_margin", p.fp8_margin, allow_zero=True)
    kept = list(p.fp8_bf16_products)
    bad = [n for n in kept if n not in FP8_PRODUCT_NAMES]
    if bad or len(set(kept)) != len(kept):
        raise ConfigError(f"config key precision.fp8_bf16_products = {kept}: "
                          f"{'unknown' if bad else 'repeated'} product names {bad or kept}; the FP8 products are "
                          f"{', '.join(FP8_PRODUCT_NAMES)} (an empty list keeps none in bf16).")
    if p.fp8_recipe == "mxfp8" and cfg.model.matmul_impl == "pallas":
        raise ConfigError("model.matmul_impl = 'pallas' with precision.fp8_recipe = 'mxfp8': there is no Pallas "
                          "MXFP8 kernel (MXFP8 runs through jax.nn.scaled_matmul on Blackwell GPUs and its exact "
                          "emulation elsewhere); set model.matmul_impl=xla, or choose precision.fp8_recipe="
                          "blockwise for the Pallas blockwise kernel.")
    if t.precision != "fp8" and cfg.model.matmul_impl != "xla":
        raise ConfigError(f"model.matmul_impl = {cfg.model.matmul_impl!r} picks the implementation of the "
                          f"FP8 products and needs train.precision=fp8 (this run has train.precision="
                          f"{t.precision}); set train.precision=fp8 or leave model.matmul_impl=xla.")


def expert_tensor_folded(cfg: Config) -> bool:
    """Whether parallel.expert_tensor_parallel folds the tensor (and context) devices into the
    experts' expert parallelism (it is 1 while the tensor size is > 1)."""
    etp = cfg.parallel.expert_tensor_parallel
    return etp is not None and etp != cfg.mesh.tensor * cfg.mesh.dcn.tensor


def _check_expert_tensor_parallel(cfg: Config) -> None:
    etp = cfg.parallel.expert_tensor_parallel
    if etp is None:
        return
    tensor = cfg.mesh.tensor * cfg.mesh.dcn.tensor
    if cfg.mesh.tensor == -1:
        raise ConfigError(f"parallel.expert_tensor_parallel = {etp} needs the tensor size set: mesh.tensor is -1 "
                          f"(filled from the device count). Set mesh.tensor (and another axis to -1), or leave "
                          f"parallel.expert_tensor_parallel unset (null: the tensor size).")
    if etp not in (1, tensor):
        raise ConfigError(f"parallel.expert_tensor_parallel = {etp}: accepted values are 1 (the experts whole on "
                          f"each device, the tensor and context devices folded into expert parallelism) or the "
                          f"tensor size mesh.tensor x mesh.dcn.tensor = {tensor} (each expert split like the dense "
                          f"MLP; null means this); sizes in between are not supported.")
    if etp != tensor and not cfg.model.num_experts:
        raise ConfigError(f"parallel.expert_tensor_parallel = {etp} sets the routed experts' tensor size, but "
                          f"model.num_experts is 0 (dense). Set model.num_experts or leave "
                          f"parallel.expert_tensor_parallel unset.")


def validate_moe(cfg: Config) -> None:
    """Mixture-of-experts keys, and mesh.expert (which only a MoE model can use)."""
    m = cfg.model
    _positive("model.num_experts", m.num_experts, allow_zero=True)
    _positive("model.moe_shared_expert_ffn_size", m.moe_shared_expert_ffn_size, allow_zero=True)
    expert = cfg.mesh.expert * cfg.mesh.dcn.expert
    if m.num_experts == 0:
        if m.moe_shared_expert_ffn_size:
            raise ConfigError(f"model.moe_shared_expert_ffn_size = {m.moe_shared_expert_ffn_size} needs a "
                              f"mixture-of-experts model: model.num_experts is 0 (dense). Set model.num_experts, "
                              f"or use 0 (no shared expert) and size the dense MLP with model.ffn_hidden_size.")
        if expert != 1:
            raise ConfigError(f"mesh.expert = {cfg.mesh.expert} (x mesh.dcn.expert = {cfg.mesh.dcn.expert}) "
                              f"needs a mixture-of-experts model: model.num_experts is 0 (dense). Set "
                              f"model.num_experts or use mesh.expert=1.")
        _check_expert_tensor_parallel(cfg)
        return
    _check_expert_tensor_parallel(cfg)
    _positive("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size)
    _check_router_groups(m)
    if m.moe_shared_expert_gate and not m.moe_shared_expert_ffn_size:
        raise ConfigError("model.moe_shared_expert_gate = true gates the shared expert, but "
                          "model.moe_shared_expert_ffn_size is 0 (none). Set moe_shared_expert_ffn_size > 0, or "
                          "model.moe_shared_expert_gate=false.")
    _positive("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, allow_zero=True)
    _positive("model.moe_z_loss_coeff", m.moe_z_loss_coeff, allow_zero=True)
    if not 1 <= m.moe_router_topk <= m.num_experts:
        raise ConfigError(f"model.moe_router_topk = {m.moe_router_topk}: each token goes to top-k of the "
                          f"model.num_experts = {m.num_experts} experts, so it must be in 1..{m.num_experts}.")
    if m.moe_expert_capacity_factor is not None and not m.moe_expert_capacity_factor > 0:
        raise ConfigError(f"model.moe_expert_capacity_factor = {m.moe_expert_capacity_factor}: must be > 0 "
                          f"(e.g. 1.0 or 1.25), or null for dropless routing.")
    _positive("model.moe_router_topk_scaling_factor", m.moe_router_topk_scaling_factor)
    _positive("model.moe_router_bias_update_rate", m.moe_router_bias_update_rate, allow_zero=True)
    if m.moe_router_bias_update_rate > 0 and m.moe_router_score_function != "sigmoid":
        raise ConfigError(f"model.moe_router_bias_update_rate = {m.moe_router_bias_update_rate} needs "
                          f"model.moe_router_score_function=sigmoid (this config has "
                          f"{m.moe_router_score_function!r}): the expert bias is added to sigmoid scores, as in "
                          f"Megatron-Core. Set moe_router_score_function=sigmoid or moe_router_bias_update_rate=0.")
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        raise ConfigError(f"model.moe_router_pre_softmax = true is softmax routing (softmax over all experts, "
                          f"then top-k), but model.moe_router_score_function = {m.moe_router_score_function!r}. "
                          f"Set moe_router_score_function=softmax or moe_router_pre_softmax=false.")
    if isinstance(m.moe_layer_freq, list):
        _check_dense_first(cfg)
    else:
        _positive("model.moe_layer_freq", m.moe_layer_freq)
    if not isinstance(m.moe_layer_freq, list) and m.num_layers % m.moe_layer_freq:
        ok = [n for n in range(1, m.num_layers + 1) if m.num_layers % n == 0]
        raise ConfigError(f"model.moe_layer_freq = {m.moe_layer_freq} does not divide model.num_layers = "
                          f"{m.num_layers}: the layers run in groups of one MoE layer and moe_layer_freq - 1 "
                          f"dense ones. Accepted for {m.num_layers} layers: {', '.join(map(str, ok))}.")
    if cfg.parallel.moe_all_to_all == "ragged" and m.moe_expert_capacity_factor is not None:
        raise ConfigError(f"parallel.moe_all_to_all = ragged with model.moe_expert_capacity_factor = "
                          f"{m.moe_expert_capacity_factor}: capacity mode's buffers are fixed-size already; the "
                          f"ragged exchange is for dropless routing. Use parallel.moe_all_to_all=padded, or "
                          f"model.moe_expert_capacity_factor=null.")
    if cfg.parallel.moe_token_dispatcher == "allgather" and m.moe_expert_capacity_factor is not None:
        raise ConfigError(f"parallel.moe_token_dispatcher = allgather with model.moe_expert_capacity_factor = "
                          f"{m.moe_expert_capacity_factor}: the allgather dispatcher is dropless; capacity mode "
                          f"exchanges its fixed [experts, capacity] buffers with alltoall. Use "
                          f"parallel.moe_token_dispatcher=alltoall (or auto), or model.moe_expert_capacity_factor=null.")
    if cfg.parallel.moe_token_dispatcher == "allgather" and cfg.parallel.moe_all_to_all == "ragged":
        raise ConfigError("parallel.moe_all_to_all = ragged chooses the all-to-all of the alltoall dispatcher, but "
                          "parallel.moe_token_dispatcher = allgather exchanges no all-to-all. Use "
                          "parallel.moe_token_dispatcher=alltoall with moe_all_to_all=ragged, or "
                          "moe_all_to_all=padded with allgather.")
    if m.use_bias:
        raise ConfigError("model.use_bias = true with model.num_experts > 0: experts and router have no "
                          "biases (as in Mixtral); set model.use_bias=false (family gpt defaults to true).")


def moe_token_dispatcher(cfg: Config, platform: str) -> str:
    """parallel.moe_token_dispatcher resolved for devices of `platform`: `auto` is `allgather` on CPU for
    dropless routing with padded buffers (ep x T token rows move instead of ep x T x K assignment
    rows, and the experts' work follows the real rows), `alltoall` otherwise."""
    choice = cfg.parallel.moe_token_dispatcher
    if choice != "auto":
        return choice
    dropless_padded = cfg.model.moe_expert_capacity_factor is None and cfg.parallel.moe_all_to_all == "padded"
    return "allgather" if platform == "cpu" and dropless_padded else "alltoall"


def _check_dense_first(cfg: Config) -> None:
    """moe_layer_freq's list form: one 0/1 per layer, the dense layers (0) first."""
    m, freq = cfg.model, cfg.model.moe_layer_freq
    k = sum(1 for f in freq if f == 0)
    if len(freq) != m.num_layers or any(f not in (0, 1) for f in freq) or freq != [0] * k + [1] * (m.num_layers - k):
        raise ConfigError(f"model.moe_layer_freq = {freq}: the list form needs one 0 (dense) or 1 (MoE) per layer "
                          f"(model.num_layers = {m.num_layers}), the dense layers first, e.g. [0, 1, 1] (DeepSeek-V3's "
                          f"first_k_dense_replace); other patterns: use the integer form (every Nth layer is MoE).")
    if k == m.num_layers:
        raise ConfigError(f"model.moe_layer_freq = {freq} has no MoE layer; use model.num_experts=0 for a dense model.")


def validate_mtp(cfg: Config) -> None:
    m = cfg.model
    _positive("model.mtp_num_layers", m.mtp_num_layers, allow_zero=True)
    _positive("model.mtp_loss_scaling_factor", m.mtp_loss_scaling_factor, allow_zero=True)
    if m.mtp_block == "moe" and not m.num_experts:
        raise ConfigError("model.mtp_block = 'moe' needs a mixture-of-experts model (model.num_experts > 0); "
                          "use auto or dense.")


HYBRID_SYMBOLS = {"M": "a Mamba-2 mixer", "*": "attention", "-": "an MLP", "E": "a mixture of experts",
                  "|": "a pipeline-stage boundary"}


def validate_hybrid(cfg: Config) -> None:
    """hybrid_layer_pattern (Megatron's syntax) and the Mamba mixers' sizes."""
    m = cfg.model
    pattern = m.hybrid_layer_pattern
    if pattern is None:
        return
    accepted = ", ".join(f"{k} {v}" for k, v in HYBRID_SYMBOLS.items())
    bad = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if not m.hybrid_pattern() or bad:
        raise ConfigError(f"model.hybrid_layer_pattern = {pattern!r}: "
                          + (f"unknown symbol(s) {', '.join(map(repr, bad))}; " if bad else "no layer; ")
                          + f"one character per layer, accepted: {accepted} (e.g. 'M*M-ME').")
    if m.num_layers != len(m.hybrid_pattern()):
        raise ConfigError(f"model.num_layers = {m.num_layers} contradicts model.hybrid_layer_pattern = {pattern!r}, "
                          f"which has {len(m.hybrid_pattern())} layers; leave num_layers unset (the pattern gives it) "
                          f"or make them agree.")
    if "|" in pattern and "" in pattern.split("|"):
        raise ConfigError(f"model.hybrid_layer_pattern = {pattern!r} has a pipeline stage without layers ('|' at "
                          f"an end or '||'); every stage needs at least one layer (e.g. 'M*-E|M*-E').")
    if "E" in pattern and not m.num_experts:
        raise ConfigError(f"model.hybrid_layer_pattern = {pattern!r} has mixture-of-experts layers (E) and "
                          f"model.num_experts = 0; set num_experts (and moe_router_topk).")
    if m.num_experts and "E" not in pattern:
        raise ConfigError(f"model.num_experts = {m.num_experts} with model.hybrid_layer_pattern = {pattern!r}, which "
                          f"has no mixture-of-experts layer (E): a hybrid's pattern places its experts; add E "
                          f"layers or set num_experts=0.")
    if m.moe_layer_freq != 1:
        raise ConfigError(f"model.moe_layer_freq = {m.moe_layer_freq} with model.hybrid_layer_pattern = {pattern!r}: "
                          f"a hybrid's pattern places its MoE layers (E); leave moe_layer_freq at 1.")
    for key, why in (("multi_latent_attention", "multi-latent attention"), ("mtp_num_layers", "multi-token prediction")):
        if getattr(m, key):
            raise ConfigError(f"model.{key} = {getattr(m, key)} with model.hybrid_layer_pattern = {pattern!r}: "
                              f"{why} is not part of the hybrid models yet; set it off.")
    if "M" not in pattern:
        return
    for key in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_chunk_size",
                "mamba_conv_kernel", "mamba_dt_min", "mamba_dt_max"):
        _positive(f"model.{key}", getattr(m, key))
    q = m.mamba_chunk_size
    if m.mamba_ssd_impl == "pallas" and (q < 16 or q & (q - 1)):
        raise ConfigError(f"model.mamba_chunk_size = {q} with model.mamba_ssd_impl = pallas: the kernel's programs hold "
                          f"one chunk, a power of two >= 16 (16, 32, 64, 128, 256); or use mamba_ssd_impl=xla.")
    if m.mamba_num_heads % m.mamba_num_groups:
        ok = [g for g in range(1, m.mamba_num_heads + 1) if m.mamba_num_heads % g == 0]
        raise ConfigError(f"model.mamba_num_groups = {m.mamba_num_groups} does not divide model.mamba_num_heads = "
                          f"{m.mamba_num_heads} (each group's B and C serve whole heads); accepted: "
                          f"{', '.join(map(str, ok))}.")
    top = math.inf if m.mamba_time_step_max is None else m.mamba_time_step_max
    if not 0.0 <= m.mamba_time_step_min < top:
        raise ConfigError(f"model.mamba_time_step_min = {m.mamba_time_step_min} and model.mamba_time_step_max = "
                          f"{m.mamba_time_step_max}: the time step is clamped to [min, max], 0 <= min < max "
                          f"(max may be null: no limit).")
    if m.mamba_dt_min > m.mamba_dt_max:
        raise ConfigError(f"model.mamba_dt_min = {m.mamba_dt_min} is above model.mamba_dt_max = {m.mamba_dt_max}.")


def validate_yarn(cfg: Config) -> None:
    """rope_scaling=yarn: multi-latent attention only (its gains are applied there), positive keys."""
    m = cfg.model
    if m.rope_scaling != "yarn":
        return
    if not m.multi_latent_attention:
        raise ConfigError("model.rope_scaling = yarn is implemented for multi-latent attention "
                          "(model.multi_latent_attention=true, DeepSeek-V3) only; accepted for this model: none, llama3.")
    for key in ("rope_scaling_factor", "rope_original_max_position", "rope_beta_fast", "rope_beta_slow"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("rope_mscale", "rope_mscale_all_dim"):
        _positive(f"model.{key}", getattr(m, key), allow_zero=True)
    if m.rope_beta_slow >= m.rope_beta_fast:
        raise ConfigError(f"model.rope_beta_slow = {m.rope_beta_slow} must be below model.rope_beta_fast = "
                          f"{m.rope_beta_fast} (YaRN interpolates the dims turning fewer than beta_slow times over "
                          f"the original context, keeps those turning more than beta_fast).")


def validate_mla(cfg: Config) -> None:
    """Multi-latent attention's keys and what it does not run with yet (refused by name)."""
    m = cfg.model
    if not m.multi_latent_attention:
        return
    for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank"):
        _positive(f"model.{key}", getattr(m, key))
    if m.qk_norm:
        raise ConfigError("model.multi_latent_attention = true with model.qk_norm = true: multi-latent attention "
                          "normalises its q and kv latents (always); per-head q/k norms are not part of it. "
                          "Set model.qk_norm=false.")
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"model.qk_pos_emb_head_dim = {m.qk_pos_emb_head_dim} must be even (rotary pairs).")
    if m.num_kv_heads != m.num_heads:
        raise ConfigError(f"model.multi_latent_attention = true with model.num_kv_heads = {m.num_kv_heads} != "
                          f"model.num_heads = {m.num_heads}: every head has its own k and v from the latent; "
                          f"leave num_kv_heads unset.")
    if m.position_embedding != "rope" or m.use_bias:
        raise ConfigError("model.multi_latent_attention = true needs rotary positions and no biases "
                          "(model.family=llama, position_embedding=rope, use_bias=false).")
    qk_dim = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.attention_impl != "xla" and m.v_head_dim > qk_dim:
        raise ConfigError(f"model.multi_latent_attention = true with model.attention_impl = {m.attention_impl!r} and "
                          f"model.v_head_dim = {m.v_head_dim} > qk_head_dim + qk_pos_emb_head_dim = {qk_dim}: the "
                          f"{m.attention_impl} kernel takes one head dim, so v is padded to q's, which needs "
                          f"v_head_dim <= {qk_dim}; use model.attention_impl=xla.")


def _check_router_groups(m: ModelConfig) -> None:
    groups, pick = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and pick is None:
        return
    if groups is None or pick is None:
        raise ConfigError(f"model.moe_router_num_groups = {groups} and model.moe_router_group_topk = {pick}: "
                          f"group-limited routing needs both (or neither, for plain top-k).")
    _positive("model.moe_router_num_groups", groups)
    _positive("model.moe_router_group_topk", pick)
    e, k = m.num_experts, m.moe_router_topk
    if e % groups:
        ok = [g for g in range(1, e + 1) if e % g == 0]
        raise ConfigError(f"model.moe_router_num_groups = {groups} does not divide model.num_experts = {e}; "
                          f"accepted: {', '.join(map(str, ok))}.")
    if not 1 <= pick <= groups or k % pick or k // pick > e // groups:
        ok = [p for p in range(1, groups + 1) if k % p == 0 and k // p <= e // groups]
        raise ConfigError(f"model.moe_router_group_topk = {pick}: each token picks that many of the {groups} "
                          f"groups, each scored by its moe_router_topk / group_topk best experts (topk = {k}, "
                          f"{e // groups} experts per group), so it must divide {k} and be in 1..{groups}; "
                          f"accepted: {', '.join(map(str, ok)) or 'none (change moe_router_num_groups)'}.")


def validate_distributed_and_ops(cfg: Config) -> None:
    d, o = cfg.distributed, cfg.ops
    _positive("distributed.num_processes", d.num_processes)
    _positive("distributed.process_id", d.process_id, allow_zero=True)
    _positive("distributed.initialization_timeout", d.initialization_timeout)
    _positive("distributed.heartbeat_timeout", d.heartbeat_timeout)
    if d.coordinator_port is not None and not 0 < d.coordinator_port < 65536:
        raise ConfigError(f"config key distributed.coordinator_port = {d.coordinator_port}: must be a TCP "
                          f"port, 1..65535.")
    if d.num_processes is not None and d.process_id is not None and d.process_id >= d.num_processes:
        raise ConfigError(f"distributed.process_id={d.process_id} must be below distributed.num_processes="
                          f"{d.num_processes} (ids run 0..{d.num_processes - 1}).")
    if d.local_device_ids is not None and not all(isinstance(i, int) and i >= 0 for i in d.local_device_ids):
        raise ConfigError(f"config key distributed.local_device_ids = {d.local_device_ids}: expected a list "
                          f"of device ordinals such as [0, 1, 2, 3].")
    _positive("ops.hang_factor", o.hang_factor, allow_zero=True)
    _positive("ops.hang_timeout", o.hang_timeout, allow_zero=True)
    if not 0 <= o.prometheus_port < 65536:
        raise ConfigError(f"config key ops.prometheus_port = {o.prometheus_port}: must be a TCP port "
                          f"(1..65535), or 0 for no endpoint.")
    if o.profile_steps is not None:
        steps = o.profile_steps
        if (len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                or not 1 <= steps[0] <= steps[1]):
            raise ConfigError(f"config key ops.profile_steps = {steps}: expected [first, last] with "
                              f"1 <= first <= last, e.g. [10, 12].")
