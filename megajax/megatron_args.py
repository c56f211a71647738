"""Megatron-LM's argument names in megajax's vocabulary: one table, `FLAGS`.

Each row is one `pretrain_gpt.py` flag: the megajax config key it sets and how its value converts,
or no key and a note saying why (megajax needs nothing for it, or has no counterpart). Three
readers share the table:

- config errors: an unknown key that is a Megatron name (`train.train_iters`, `num_layers`)
  names the megajax key (`hint`);
- the CLI: a Megatron flag typed as an option of `megajax train` is answered with its megajax
  override (`spell`);
- `megajax config from-megatron -- ARGS...`: a whole argument list becomes a config tree and a
  YAML file whose comments say where each key came from and which flags were not mapped
  (`translate`, `Translation.to_yaml`).

docs/megatron-users.md holds the table as `markdown_table()` writes it (a test keeps them equal).
This module imports nothing from megajax: config.py imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from megajax.megatron_rules import FLOAT, INT, LIST, STR, SWITCH, conflicts, placeholder, refusal

_UNSET = object()

@dataclass(frozen=True)
class Flag:
    """One Megatron flag. `key` None: nothing set; `same` says whether that is because megajax
    needs nothing (True) or has no counterpart (False); `note` says why, or how the value converts."""
    flag: str  # "--num-layers"
    key: str | None
    takes: str = INT
    value: Any = None  # SWITCH: the key's value; STR: a dict of Megatron value -> megajax value (others refused)
    note: str = ""
    same: bool = False
    default: Any = _UNSET  # Megatron's value when the flag is absent, written because megajax's default differs
    when: str = ""  # the default applies only to a "moe" model or an "fp8" run

    @property
    def name(self) -> str:
        """Megatron's argparse name: --num-layers -> num_layers."""
        return self.flag[2:].replace("-", "_")


def _same(flag: str, note: str, takes: str = SWITCH) -> Flag:
    return Flag(flag, None, takes, note=note, same=True)


def _none(flag: str, note: str, takes: str = SWITCH) -> Flag:
    return Flag(flag, None, takes, note=note)


XLA_FUSES = "XLA fuses these operations itself"
OVERLAP = "XLA's scheduler overlaps communication with compute; nothing to set"
HF_TOKENIZER = "megajax reads a Hugging Face tokenizer.json; set data.tokenizer to one (file or directory)"

FLAGS: tuple[Flag, ...] = (
    # Model
    Flag("--num-layers", "model.num_layers"),
    Flag("--hidden-size", "model.hidden_size"),
    Flag("--ffn-hidden-size", "model.ffn_hidden_size",
         note="Megatron's default when absent: 4 x hidden, with --swiglu 2/3 of that rounded down to 64"),
    Flag("--num-attention-heads", "model.num_heads"),
    Flag("--num-query-groups", "model.num_kv_heads", note="only with --group-query-attention, as in Megatron"),
    _same("--group-query-attention", "turns --num-query-groups on; alone, Megatron's one query group: "
                                     "model.num_kv_heads=1"),
    Flag("--kv-channels", "model.head_dim"),
    Flag("--seq-length", "train.seq_len"),
    Flag("--max-position-embeddings", "model.max_position_embeddings"),
    Flag("--vocab-size", "model.vocab_size", note="with --tokenizer-type NullTokenizer one more: that tokenizer's "
                                                  "end-of-document id, --vocab-size itself"),
    Flag("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by",
         note="megajax pads to this multiple alone, not times the tensor size"),
    Flag("--normalization", "model.norm", STR, {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}, default="layernorm"),
    Flag("--norm-epsilon", "model.norm_eps", FLOAT),
    Flag("--swiglu", "model.activation", SWITCH, "swiglu", default="gelu_tanh",
         note="without it Megatron's MLP is GELU, computed by its fused bias-GELU: the tanh approximation; "
              "--no-bias-gelu-fusion or --disable-bias-linear make it the exact GELU, gelu"),
    Flag("--position-embedding-type", "model.position_embedding", STR,
         {"learned_absolute": "learned", "rope": "rope", "none": "none"}, default="learned"),
    Flag("--use-rotary-position-embeddings", "model.position_embedding", SWITCH, "rope"),
    Flag("--rotary-base", "model.rope_theta"),
    Flag("--use-rope-scaling", "model.rope_scaling", SWITCH, "llama3"),
    Flag("--rope-scaling-factor", "model.rope_scaling_factor", FLOAT),
    Flag("--disable-bias-linear", "model.use_bias", SWITCH, False, default=True),
    Flag("--add-bias-linear", "model.use_bias", SWITCH, True),
    Flag("--untie-embeddings-and-output-weights", "model.tie_embeddings", SWITCH, False, default=True),
    Flag("--hidden-dropout", "model.hidden_dropout", FLOAT, default=0.1),
    Flag("--attention-dropout", "model.attention_dropout", FLOAT, default=0.1),
    Flag("--init-method-std", "model.init_std", FLOAT),
    Flag("--attention-backend", "model.attention_impl", STR,
         {"flash": "flash", "fused": "cudnn", "unfused": "xla", "local": "xla", "auto": None},
         note="flash: the Pallas kernel, fused: cuDNN, unfused/local: plain XLA; auto: megajax's default"),
    Flag("--use-flash-attn", "model.attention_impl", SWITCH, "flash"),
    Flag("--qk-layernorm", "model.qk_norm", SWITCH, True, note="per-head RMSNorm of q and k (with --normalization RMSNorm)"),
    _same("--use-mcore-models", "megajax has one model implementation"),
    _same("--transformer-impl", "megajax's layers are its own (no Transformer Engine)", STR),
    _same("--no-position-embedding", "the position embedding follows --position-embedding-type"),
    _none("--rotary-percent", "megajax rotates the whole head (only 1.0 is the same)", FLOAT),
    _none("--apply-layernorm-1p", "megajax stores the norm scale itself, not a zero-centred offset"),
    Flag("--squared-relu", "model.activation", SWITCH, "squared_relu"),
    _none("--rotary-seq-len-interpolation-factor", "megajax's RoPE scaling is Llama 3's (--use-rope-scaling)", INT),
    Flag("--pixel-shuffle", "model.vision.pixel_shuffle", SWITCH, True,
         note="a vision-language model's image features: each 2 x 2 patch neighbourhood one feature"),
    _same("--use-tiling", "images are tiled whenever model.vision.max_num_tiles (--max-num-tiles) is above 1"),
    Flag("--max-num-tiles", "model.vision.max_num_tiles",
         note="tiles per image (NVLM's dynamic tiling); megajax tiles when it is above 1, --use-tiling or not"),
    Flag("--use-thumbnail", "model.vision.use_thumbnail", SWITCH, True,
         note="the whole image as a last tile when an image takes several"),
    Flag("--use-tile-tags", "model.vision.tile_tags", SWITCH, True,
         note="NVLM's text tags (`<tile_1>`, ..., `<tile_global_thumbnail>`) before each tile's placeholders"),
    # Hybrid (Mamba) models: pretrain_mamba.py's flags
    Flag("--hybrid-override-pattern", "model.hybrid_layer_pattern", STR,
         note="one character per layer: M Mamba-2, * attention, - MLP, E MoE"),
    Flag("--hybrid-layer-pattern", "model.hybrid_layer_pattern", STR,
         note="newer Megatron-LM's name; its pipeline-stage boundaries read as megajax's"),
    _same("--is-hybrid-model", "a model with model.hybrid_layer_pattern is a hybrid"),
    _none("--hybrid-attention-ratio", "megajax takes the layer pattern itself (--hybrid-override-pattern)", FLOAT),
    _none("--hybrid-mlp-ratio", "megajax takes the layer pattern itself (--hybrid-override-pattern)", FLOAT),
    Flag("--mamba-state-dim", "model.mamba_state_dim"),
    Flag("--mamba-head-dim", "model.mamba_head_dim"),
    Flag("--mamba-num-groups", "model.mamba_num_groups"),
    Flag("--mamba-num-heads", "model.mamba_num_heads", note="absent: 2 x hidden / head dim, as in Megatron"),
    # Mixture of experts
    Flag("--num-experts", "model.num_experts"),
    Flag("--moe-router-topk", "model.moe_router_topk"),
    Flag("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size"),
    Flag("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff", FLOAT, default=0.0, when="moe"),
    Flag("--moe-z-loss-coeff", "model.moe_z_loss_coeff", FLOAT),
    Flag("--moe-expert-capacity-factor", "model.moe_expert_capacity_factor", FLOAT),
    Flag("--moe-layer-freq", "model.moe_layer_freq", note="the integer form (every Nth layer); a list is not mapped"),
    Flag("--moe-shared-expert-intermediate-size", "model.moe_shared_expert_ffn_size"),
    Flag("--moe-router-score-function", "model.moe_router_score_function", STR,
         {"softmax": "softmax", "sigmoid": "sigmoid"}),
    Flag("--moe-router-topk-scaling-factor", "model.moe_router_topk_scaling_factor", FLOAT),
    Flag("--moe-router-pre-softmax", "model.moe_router_pre_softmax", SWITCH, True),
    Flag("--moe-router-num-groups", "model.moe_router_num_groups"),
    Flag("--moe-router-group-topk", "model.moe_router_group_topk"),
    Flag("--moe-router-enable-expert-bias", "model.moe_router_bias_update_rate", SWITCH, 1e-3,
         note="with Megatron's update rate 1e-3 unless --moe-router-bias-update-rate gives one"),
    Flag("--moe-router-bias-update-rate", "model.moe_router_bias_update_rate", FLOAT,
         note="only with --moe-router-enable-expert-bias"),
    Flag("--moe-router-load-balancing-type", None, STR, {"aux_loss": None},
         note="megajax balances with the auxiliary loss (model.moe_aux_loss_coeff); other types are not mapped"),
    Flag("--moe-token-dispatcher-type", "parallel.moe_token_dispatcher", STR,
         {"alltoall": "alltoall", "allgather": "allgather"},
         note="the dispatcher changes speed, not results; without the flag megajax chooses (auto); flex is not "
              "mapped"),
    _same("--moe-grouped-gemm", "megajax's experts run as one batched product"),
    _same("--moe-permute-fusion", XLA_FUSES),
    # Parallelism
    Flag("--tensor-model-parallel-size", "mesh.tensor"),
    Flag("--pipeline-model-parallel-size", "mesh.pipeline"),
    Flag("--context-parallel-size", "mesh.context"),
    Flag("--encoder-tensor-model-parallel-size", "parallel.encoder_tensor_parallel",
         note="a vision-language model's encoder and projector: 0 as mesh.tensor, 1 whole on every tensor rank"),
    Flag("--expert-model-parallel-size", "mesh.expert"),
    Flag("--sequence-parallel", "parallel.sequence_parallel", SWITCH, True),
    Flag("--use-distributed-optimizer", "parallel.distributed_optimizer", SWITCH, True),
    Flag("--use-torch-fsdp2", "mesh.fsdp", SWITCH, -1, note="with mesh.data=1: parameters, gradients and "
                                                            "optimizer state sharded over the data-parallel devices"),
    Flag("--virtual-pipeline-model-parallel-size", "parallel.virtual_stages",
         note="also sets parallel.pipeline_schedule=interleaved"),
    Flag("--num-layers-per-virtual-pipeline-stage", "parallel.virtual_stages",
         note="virtual stages = layers / (pipeline size x this); also the interleaved schedule"),
    Flag("--cp-comm-type", "parallel.context_impl", STR, {"p2p": "ring", "allgather": "allgather"},
         note="one type for every layer; a2a is not mapped"),
    Flag("--recompute-granularity", "parallel.recompute", STR, {"full": "full", "selective": "selective"}),
    Flag("--recompute-activations", "parallel.recompute", SWITCH, "selective"),
    _none("--recompute-method", "megajax's full recompute covers every layer", STR),
    _none("--recompute-num-layers", "megajax's full recompute covers every layer", INT),
    Flag("--expert-tensor-parallel-size", "parallel.expert_tensor_parallel",
         note="1 (MoE parallel folding) or the tensor size; with 1, mesh.expert = --expert-model-parallel-size / "
              "(tensor x context sizes)"),
    _same("--overlap-grad-reduce", OVERLAP),
    _same("--overlap-param-gather", OVERLAP),
    _same("--overlap-p2p-communication", OVERLAP),
    _same("--tp-comm-overlap", "megajax's parallel.tp_comm_overlap, on by default: on GPUs the sequence-parallel "
                               "products run as collective matmuls"),
    _same("--distributed-backend", "megajax runs on JAX's runtime", STR),
    _none("--distributed-timeout-minutes", "megajax's watchdog is ops.hang_timeout (seconds)", INT),
    # Precision
    Flag("--bf16", "train.precision", SWITCH, "bf16"),
    Flag("--fp16", "train.precision", SWITCH, "fp16"),
    Flag("--fp8-format", "train.precision", STR, {"hybrid": "fp8", "e4m3": "fp8"},
         note="e4m3 forward and e5m2 gradients; wins over --bf16"),
    Flag("--fp8-recipe", "precision.fp8_recipe", STR, {"delayed": "delayed", "tensorwise": "current",
                                                      "blockwise": "blockwise", "mxfp8": "mxfp8"}),
    Flag("--fp8-amax-history-len", "precision.fp8_amax_history_len", default=1, when="fp8"),
    Flag("--fp8-margin", "precision.fp8_margin"),
    Flag("--fp8-amax-compute-algo", None, STR, {"max": None},
         note="megajax scales by the history's maximum; most_recent is not mapped"),
    Flag("--fp8-param-gather", "precision.fp8_param_gather", SWITCH, True,
         note="FSDP gathers the FP8 products' weights as float8; the parameters stay bf16 with an fp32 master"),
    Flag("--main-params-dtype", None, STR, {"fp32": None},
         note="megajax's master copy of 16-bit parameters is fp32 (precision.param_dtype=compute, the default)"),
    _none("--grad-reduce-in-bf16", "megajax's gradient reduction dtype is not configurable"),
    _same("--accumulate-allreduce-grads-in-fp32", "megajax accumulates gradients in fp32"),
    _same("--attention-softmax-in-fp32", "megajax's softmax runs in fp32"),
    Flag("--initial-loss-scale", "train.initial_loss_scale", FLOAT),
    Flag("--min-loss-scale", "train.min_loss_scale", FLOAT),
    Flag("--loss-scale-window", "train.loss_scale_window", FLOAT),
    Flag("--hysteresis", "train.hysteresis"),
    _none("--loss-scale", "megajax's fp16 loss scale is dynamic only", FLOAT),
    # Optimizer and schedule
    Flag("--lr", "optim.lr", FLOAT),
    Flag("--min-lr", "optim.min_lr", FLOAT, default=0.0),
    Flag("--lr-decay-style", "optim.decay_style", STR,
         {"cosine": "cosine", "linear": "linear", "constant": "constant"}, default="linear"),
    Flag("--lr-decay-iters", "optim.decay_steps"),
    Flag("--lr-decay-samples", "optim.decay_steps", note="samples / global batch, rounded down"),
    Flag("--lr-warmup-iters", "optim.warmup_steps", default=0),
    Flag("--lr-warmup-samples", "optim.warmup_steps", note="samples / global batch, rounded down"),
    Flag("--lr-warmup-fraction", "optim.warmup_steps", FLOAT, note="fraction x decay steps, rounded down"),
    _none("--lr-warmup-init", "megajax's warmup starts from 0", FLOAT),
    Flag("--weight-decay", "optim.weight_decay", FLOAT, default=0.01),
    Flag("--adam-beta1", "optim.beta1", FLOAT),
    Flag("--adam-beta2", "optim.beta2", FLOAT, default=0.999),
    Flag("--adam-eps", "optim.eps", FLOAT),
    Flag("--clip-grad", "optim.clip_grad", FLOAT),
    Flag("--optimizer", None, STR, {"adam": None}, note="megajax's optimizer is AdamW; sgd is not mapped"),
    _none("--decoupled-lr", "megajax has one learning rate for all parameters", FLOAT),
    _none("--decoupled-min-lr", "megajax has one learning rate for all parameters", FLOAT),
    # Training loop
    Flag("--train-iters", "train.steps"),
    Flag("--train-samples", "train.steps", note="samples / global batch, rounded down"),
    Flag("--micro-batch-size", "train.micro_batch"),
    Flag("--global-batch-size", "train.global_batch"),
    _none("--rampup-batch-size", "megajax keeps one global batch for the whole run", LIST),
    Flag("--seed", "train.seed", default=1234),
    Flag("--log-interval", "train.log_every", default=100),
    Flag("--eval-interval", "train.eval_every", default=0),
    Flag("--eval-iters", "train.eval_steps", default=100),
    Flag("--profile", "ops.profile_steps", SWITCH, note="[--profile-step-start, --profile-step-end], "
                                                        "Megatron's 10 and 12 when absent"),
    Flag("--profile-step-start", "ops.profile_steps", note="with --profile"),
    Flag("--profile-step-end", "ops.profile_steps", note="with --profile"),
    _same("--log-throughput", "megajax logs tokens/s and MFU at every logged step"),
    _same("--tensorboard-dir", "megajax writes TensorBoard events into train.run_dir", STR),
    _same("--manual-gc", "megajax's step runs in XLA, not the Python heap"),
    _same("--empty-unused-memory-level", "XLA manages device memory", INT),
    _none("--calculate-per-token-loss", "megajax's loss averaging is not configurable"),
    _none("--exit-duration-in-mins", "megajax saves a checkpoint on SIGTERM instead", INT),
    _none("--exit-interval", "set train.steps instead", INT),
    _none("--wandb-project", "megajax logs to TensorBoard and metrics.jsonl", STR),
    _none("--wandb-exp-name", "megajax logs to TensorBoard and metrics.jsonl", STR),
    _same("--cross-entropy-loss-fusion", XLA_FUSES),
    _same("--no-masked-softmax-fusion", XLA_FUSES),
    _same("--no-bias-gelu-fusion", "Megatron's unfused GELU is the exact one: model.activation=gelu when no "
                                   "--swiglu or --squared-relu says otherwise (the fused one, its default, is the "
                                   "tanh approximation, gelu_tanh)"),
    _same("--no-bias-swiglu-fusion", XLA_FUSES),
    _same("--no-bias-dropout-fusion", XLA_FUSES),
    _same("--no-rope-fusion", XLA_FUSES),
    _same("--no-gradient-accumulation-fusion", XLA_FUSES),
    _same("--no-persist-layer-norm", XLA_FUSES),
    # Data
    Flag("--data-path", "data.path", LIST, note="one prefix, or weight prefix weight prefix ..."),
    Flag("--split", "data.split", STR),
    Flag("--data-cache-path", "data.cache_dir", STR),
    Flag("--tokenizer-model", "data.tokenizer", STR, note="with --tokenizer-type HuggingFaceTokenizer"),
    Flag("--tokenizer-type", None, STR, {"HuggingFaceTokenizer": None, "SFTTokenizer": None, "NullTokenizer": None},
         note="HuggingFaceTokenizer, SFTTokenizer: --tokenizer-model is data.tokenizer; NullTokenizer: --vocab-size "
              "ids and its end-of-document id; other types: " + HF_TOKENIZER),
    Flag("--sft", "data.format", SWITCH, "chat",
         note="jsonl conversations through the tokenizer's chat template, only the answers trained "
              "(data.loss_on), packed (data.packing)"),
    Flag("--sft-tokenizer-prompt-format", None, STR, {"default": None},
         note="default: the tokenizer's own chat template, which megajax renders; another named format: write it "
              "as the tokenizer's chat_template (tokenizer_config.json)"),
    Flag("--reset-position-ids", "data.reset_position_ids", SWITCH, True),
    Flag("--reset-attention-mask", "data.reset_attention_mask", SWITCH, True),
    Flag("--eod-mask-loss", "data.eod_mask_loss", SWITCH, True),
    _same("--mock-data", "megajax trains on its embedded corpus when data.path is empty"),
    _none("--vocab-file", HF_TOKENIZER, STR),
    _none("--merge-file", HF_TOKENIZER, STR),
    _none("--tiktoken-pattern", HF_TOKENIZER, STR),
    _same("--num-workers", "megajax prepares batches in a background thread (data.prefetch)", INT),
    _same("--no-mmap-bin-files", "megajax memory-maps .bin files"),
    _same("--no-create-attention-mask-in-dataloader", "megajax builds no attention mask in the loader"),
    # Checkpoints
    Flag("--save", "train.run_dir", STR, note="checkpoints go to <train.run_dir>/checkpoints; a rerun resumes"),
    Flag("--load", "checkpoint.load", STR,
         note="the same directory as --save: resume (nothing to set); another: fine-tune from its parameters "
              "(a Megatron checkpoint, legacy or torch_dist, is read directly, with its Adam state where a "
              "torch_dist one holds it)"),
    Flag("--save-interval", "checkpoint.every"),
    Flag("--async-save", "checkpoint.async_save", SWITCH, True),
    _same("--no-load-optim", "checkpoint.load starts the optimizer fresh (of a torch_dist Megatron checkpoint "
                             "holding Adam state: takes it)"),
    _same("--no-load-rng", "checkpoint.load starts the optimizer fresh"),
    _same("--finetune", "checkpoint.load starts from parameters alone"),
    _same("--ckpt-format", "megajax saves Orbax checkpoints; megajax export --format megatron --ckpt-format torch_dist or torch writes Megatron's", STR),
    _same("--use-dist-ckpt", "megajax's checkpoints are sharded and restore onto any mesh"),
)

BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}
SECTIONS = ("model", "mesh", "parallel", "train", "precision", "optim", "data", "checkpoint", "logging",
            "distributed", "ops")


def lookup(name: str) -> Flag | None:
    """The row of a Megatron name in any spelling: --num-layers, num-layers, num_layers."""
    return BY_NAME.get(name.lstrip("-").replace("-", "_"))


def _text(value: Any) -> str:
    """A value as an override writes it: true, 0.1, [0.3, a, 0.7, b]."""
    return yaml.safe_dump(value, default_flow_style=True, width=10 ** 6).strip().removesuffix("\n...").strip()


def hint(name: str) -> str | None:
    """For a config key's last name: what a Megatron name is in megajax, or None if it is not one."""
    f = lookup(name)
    if f is None:
        return None
    if f.key is None:
        return f"Megatron's {f.flag} {'needs no megajax key' if f.same else 'has no megajax key'}: {f.note}"
    target = f"{f.key}={_text(f.value)}" if f.takes == SWITCH and f.value is not None else f.key
    return f"Megatron's {f.flag} is {target}" + (f" ({f.note})" if f.note else "")


def spell(flag: str, value: str | None) -> str:
    """One Megatron flag typed on the megajax command line, in megajax's words (one sentence)."""
    f = lookup(flag)
    assert f is not None, flag
    if f.key is not None:
        t = translate([f.flag] + ([value] if value is not None and f.takes != SWITCH else []), defaults=False)
        sets = [f"{k}={_text(v)}" for k, (v, _) in t.assignments.items()]
        if sets:
            return f"{f.flag} is Megatron's flag; megajax spells it {' '.join(sets)}"
        shown = f"{f.key}={_text(f.value) if f.takes == SWITCH else value or 'VALUE'}"
        return f"{f.flag} is Megatron's flag; megajax spells it {shown}" + (f" ({f.note})" if f.note else "")
    return f"{f.flag} is Megatron's flag; megajax {'needs nothing for it' if f.same else 'has no equivalent'}: {f.note}"


# ----------------------------------------------------------------------------------------------
# Translating an argument list

@dataclass
class Translation:
    """A Megatron argument list in megajax's terms.

    assignments: dotted key -> (value, where it came from: the flag as given, or Megatron's default);
    needless / unmapped: (the flag as given, why) for flags that set nothing; refused: (the flags as given,
    why) for what Megatron's parse_args / validate_args would refuse (`megajax config from-megatron` stops)."""
    assignments: dict[str, tuple[Any, str]] = field(default_factory=dict)
    needless: list[tuple[str, str]] = field(default_factory=list)
    unmapped: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)

    def tree(self) -> dict:
        """The nested config mapping (what load_config takes as `base`)."""
        out: dict = {}
        for key, (value, _) in self.assignments.items():
            *parents, last = key.split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        return out

    def to_yaml(self) -> str:
        """The config as YAML; each key's comment names the flag it came from, and a header lists the
        flags that needed nothing and those that were not mapped (with why)."""
        lines = ["# megajax config from Megatron-LM pretrain_gpt.py arguments (megajax config from-megatron).",
                 "# Each key's comment names the Megatron flag it comes from."]
        for title, items in (("Megatron flags megajax needs nothing for", self.needless),
                             ("Megatron flags not mapped", self.unmapped)):
            if items:
                lines.append(f"# {title}:")
                lines += [f"#   {given}: {why}" for given, why in items]
        order = {f.key: i for i, f in reversed(list(enumerate(FLAGS))) if f.key}
        keys = sorted(self.assignments, key=lambda k: (SECTIONS.index(k.split(".")[0]), order.get(k, 0), k))
        section = None
        for key in keys:
            value, origin = self.assignments[key]
            head, name = key.split(".", 1)
            if head != section:
                lines.append(f"{head}:")
                section = head
            lines.append(f"  {name}: {_text(value)}  # {origin}")
        return "\n".join(lines) + "\n"


def _split(argv: list[str]) -> list[tuple[str, list[str]]]:
    """['--a', '1', '--b', '--c=x y'] -> [('--a', ['1']), ('--b', []), ('--c', ['x y'])]."""
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token.partition("=")
            out.append((name, [value] if eq else []))
        elif out:
            out[-1][1].append(token)
        else:
            out.append(("", [token]))
    return out


def _unquote(value: str) -> str:
    """Quotes a shell array element kept ("--split '99,1,0'") come off."""
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def _convert(f: Flag, values: list[str]) -> tuple[Any, str | None]:
    """(value for f.key, None) or (None, why it cannot be mapped)."""
    if f.takes == SWITCH:
        return (f.value, None) if not values else (None, f"a switch, given values {' '.join(values)}")
    if not values:
        return None, "no value given"
    if f.takes == LIST:
        return values, None
    if len(values) != 1:
        return None, f"expected one value, got {' '.join(values)}"
    raw = values[0]
    if placeholder(raw) and f.takes != STR:
        return None, f"{raw} is an environment variable left unexpanded; write its value"
    try:
        value = {INT: int, FLOAT: float, STR: str}[f.takes](raw)
    except ValueError:
        return None, f"{raw!r} is not {'an integer' if f.takes == INT else 'a number'}"
    if isinstance(f.value, dict):
        if value not in f.value:
            accepted = ", ".join(k for k in f.value)
            return None, f"{raw!r} has no megajax counterpart (mapped: {accepted}); {f.note}".rstrip("; ")
        return f.value[value], None
    return value, None


def _data_path(values: list[str]) -> tuple[Any, str | None]:
    """--data-path PREFIX | W1 P1 W2 P2 ... -> 'PREFIX' | [W1, 'P1', W2, 'P2', ...]."""
    if len(values) == 1:
        return values[0], None
    try:
        weights = [float(v) for v in values[0::2]]
    except ValueError:
        return None, "several prefixes without weights; megajax's data.path list is weight prefix weight prefix ..."
    if len(values) % 2:
        return None, "an odd number of words; megajax's data.path list is weight prefix weight prefix ..."
    return [x for pair in zip(weights, values[1::2]) for x in pair], None


class _Given:
    """A split argument list while it is translated: `given` flag name -> values (the last of a repeated
    flag, as in Megatron's argparse), `order` the flags as given, `t` the Translation being built."""

    def __init__(self, argv: list[str]):
        self.t = Translation()
        self.given: dict[str, list[str]] = {}
        self.order: list[tuple[str, list[str]]] = []
        for flag, values in _split(argv):
            values = [_unquote(v) for v in values]
            text = " ".join([flag, *values]).strip()
            f = lookup(flag) if flag else None
            if not flag:
                self.t.refused.append((text, "a value without a flag before it (argparse: unrecognized arguments)"))
                continue
            if f is None:
                self.t.unmapped.append((text, "not a pretrain_gpt.py flag megajax knows"))
                continue
            why = refusal(f.name, f.takes, values)
            if why:
                self.t.refused.append((text, why))
                continue
            self.given[f.name] = values
            self.order = [o for o in self.order if lookup(o[0].split()[0]).name != f.name] + [(text, values)]

    def __contains__(self, name: str) -> bool:
        return name in self.given

    def put(self, key: str, value: Any, origin: str) -> None:
        self.t.assignments[key] = (value, origin)

    def raw(self, name: str) -> str | None:
        v = self.given.get(name)
        return v[0] if v else None

    def number(self, name: str) -> int | None:
        try:
            return int(self.raw(name))
        except (TypeError, ValueError):
            return None

    def origin(self, name: str) -> str:
        return next(text for text, _ in self.order if lookup(text.split()[0]).name == name)

    def needless(self, name: str, why: str) -> None:
        self.t.needless.append((self.origin(name), why))

    def unmapped(self, name: str, why: str) -> None:
        self.t.unmapped.append((self.origin(name), why))

    def derive(self, name: str, key: str, value: Any, why: str | None = None) -> None:
        if why:
            self.unmapped(name, why)
        else:
            self.put(key, value, self.origin(name))

    def convert(self, name: str, key: str) -> None:
        """`key` from flag `name`'s value as its FLAGS row converts it."""
        self.derive(name, key, *_convert(BY_NAME[name], self.given[name]))


# Flags whose keys depend on other flags: translated by the _derive_* functions below, not row by row.
_DERIVED = {"num_query_groups", "group_query_attention", "train_samples", "lr_decay_samples",
            "lr_warmup_samples", "lr_warmup_fraction", "virtual_pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage", "save", "load", "tokenizer_model", "tokenizer_type",
            "profile", "profile_step_start", "profile_step_end", "data_path", "fp8_format",
            "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "use_torch_fsdp2",
            "expert_model_parallel_size", "expert_tensor_parallel_size"}


def translate(argv: list[str], defaults: bool = True) -> Translation:
    """A pretrain_gpt.py argument list -> megajax keys; `defaults`: also Megatron's defaults where megajax's
    differ, and the model family."""
    g = _Given(argv)
    _translate_rows(g)
    for group in (_derive_attention_and_fp8, _derive_sample_counts, _derive_layout, _derive_checkpoints,
                  _derive_tokenizer, _derive_data_and_profile, _derive_expert_bias):
        group(g)
    g.t.refused += conflicts(g.given)
    if defaults:
        _megatron_defaults(g.t, g.given)
    return g.t


def _translate_rows(g: _Given) -> None:
    """The flags each FLAGS row maps on its own."""
    t = g.t
    for text, values in g.order:
        f = lookup(text.split()[0])
        if f.name in _DERIVED:
            continue
        if f.key is None and not isinstance(f.value, dict):
            (t.needless if f.same else t.unmapped).append((text, f.note))
            continue
        value, why = _convert(f, values)
        if why:
            t.unmapped.append((text, why))
        elif f.key is None or value is None:  # a value that needs nothing in megajax
            t.needless.append((text, f.note))
        else:
            g.put(f.key, value, text)


def _derive_attention_and_fp8(g: _Given) -> None:
    # Grouped-query attention: Megatron reads --num-query-groups only with --group-query-attention.
    if "num_query_groups" in g:
        if "group_query_attention" in g:
            g.convert("num_query_groups", "model.num_kv_heads")
        else:
            g.needless("num_query_groups", "ignored by Megatron without --group-query-attention")
    if "group_query_attention" in g:
        if "num_query_groups" in g:
            g.needless("group_query_attention", BY_NAME["group_query_attention"].note)
        else:  # Megatron's default --num-query-groups is 1: one key/value head
            g.put("model.num_kv_heads", 1, f"{g.origin('group_query_attention')} (Megatron's --num-query-groups 1)")
    # FP8 wins over --bf16 / --fp16 (those give the compute dtype around FP8 products).
    if "fp8_format" in g:
        before = g.t.assignments.get("train.precision")
        g.convert("fp8_format", "train.precision")
        if before and g.t.assignments["train.precision"][0] == "fp8":
            g.t.needless.append((before[1], "the dtype around the FP8 products; train.precision=fp8 covers it"))


def _derive_sample_counts(g: _Given) -> None:
    """Counts in samples become steps of the global batch."""
    batch = g.number("global_batch_size")
    for name, key in (("train_samples", "train.steps"), ("lr_decay_samples", "optim.decay_steps"),
                      ("lr_warmup_samples", "optim.warmup_steps")):
        if name in g:
            samples = g.number(name)
            why = (None if samples is not None and batch else
                   "needs an integer count and --global-batch-size to become steps")
            g.derive(name, key, samples // batch if not why else None, why)
    if "lr_warmup_fraction" in g:
        fraction, why = _convert(BY_NAME["lr_warmup_fraction"], g.given["lr_warmup_fraction"])
        decay = g.t.assignments.get("optim.decay_steps", g.t.assignments.get("train.steps", (None,)))[0]
        if not why and decay is None:
            why = "needs --lr-decay-iters or --train-iters to become steps"
        g.derive("lr_warmup_fraction", "optim.warmup_steps", None if why else math.floor(fraction * decay), why)


def _derive_layout(g: _Given) -> None:
    """The interleaved pipeline's virtual stages, and FSDP's mesh."""
    for name in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"):
        if name not in g:
            continue
        n, layers, stages = g.number(name), g.number("num_layers"), g.number("pipeline_model_parallel_size") or 1
        if name == "num_layers_per_virtual_pipeline_stage":
            ok = n and layers and layers % (stages * n) == 0
            n, why = (layers // (stages * n), None) if ok else (None, "needs --num-layers divisible by "
                                                                      "--pipeline-model-parallel-size x this")
        else:
            why = None if n else "expected an integer"
        g.derive(name, "parallel.virtual_stages", n, why)
        if not why:
            g.put("parallel.pipeline_schedule", "interleaved", g.origin(name))
    _derive_expert_layout(g)
    # Fully sharded data parallelism: every data-parallel device on the fsdp axis.
    if "use_torch_fsdp2" in g:
        g.convert("use_torch_fsdp2", "mesh.fsdp")
        g.put("mesh.data", 1, g.origin("use_torch_fsdp2"))


def _derive_expert_layout(g: _Given) -> None:
    """Expert parallelism: Megatron's expert group with --expert-tensor-parallel-size 1 spans the tensor
    and context ranks, so its size is mesh.expert x context x tensor (megajax's MoE parallel folding)."""
    if "expert_model_parallel_size" in g and "expert_tensor_parallel_size" not in g:
        g.convert("expert_model_parallel_size", "mesh.expert")
    if "expert_tensor_parallel_size" not in g:
        return
    etp, tp = g.number("expert_tensor_parallel_size"), g.number("tensor_model_parallel_size") or 1
    cp, ep = g.number("context_parallel_size") or 1, g.number("expert_model_parallel_size") or 1
    if etp == tp:  # each expert split over the tensor ranks, as without the flag
        g.derive("expert_tensor_parallel_size", "parallel.expert_tensor_parallel", etp)
        if "expert_model_parallel_size" in g:
            g.convert("expert_model_parallel_size", "mesh.expert")
        return
    if etp != 1:
        g.unmapped("expert_tensor_parallel_size", f"megajax's expert tensor size is 1 or the tensor size "
                                                  f"(--tensor-model-parallel-size {tp})")
        if "expert_model_parallel_size" in g:
            g.convert("expert_model_parallel_size", "mesh.expert")
        return
    g.derive("expert_tensor_parallel_size", "parallel.expert_tensor_parallel", 1)
    if ep % (tp * cp):
        why = (f"with --expert-tensor-parallel-size 1 megajax's expert group is expert x context x tensor, so "
               f"this must be a multiple of tensor x context = {tp * cp}")
        g.unmapped("expert_model_parallel_size" if "expert_model_parallel_size" in g
                   else "expert_tensor_parallel_size", why)
    elif "expert_model_parallel_size" in g:
        g.derive("expert_model_parallel_size", "mesh.expert", ep // (tp * cp))


def _derive_checkpoints(g: _Given) -> None:
    """--save is the run directory; --load elsewhere is a starting point."""
    if "save" in g:
        g.convert("save", "train.run_dir")
    if "load" in g:
        if g.raw("load") == g.raw("save"):
            g.needless("load", "the same directory as --save: a rerun resumes from it")
        else:
            g.convert("load", "checkpoint.load")


def _derive_tokenizer(g: _Given) -> None:
    """Only a Hugging Face tokenizer is data.tokenizer."""
    kind = g.raw("tokenizer_type")
    if "tokenizer_type" in g:
        f = BY_NAME["tokenizer_type"]
        if kind in f.value:
            g.needless("tokenizer_type", f.note)
        else:
            g.unmapped("tokenizer_type", HF_TOKENIZER)
    vocab = g.t.assignments.get("model.vocab_size", (None,))[0]
    if kind == "NullTokenizer" and isinstance(vocab, int):  # its ids: --vocab-size of them, then end-of-document
        g.put("model.vocab_size", vocab + 1, f"{g.origin('vocab_size')} and NullTokenizer's end-of-document id {vocab}")
    if "tokenizer_model" in g:
        if kind in ("HuggingFaceTokenizer", "SFTTokenizer"):
            g.convert("tokenizer_model", "data.tokenizer")
        else:
            g.unmapped("tokenizer_model", f"not a HuggingFaceTokenizer or SFTTokenizer; {HF_TOKENIZER}")


def _derive_data_and_profile(g: _Given) -> None:
    if "data_path" in g:
        g.derive("data_path", "data.path", *_data_path(g.given["data_path"]))
    if "profile" in g:
        first, last = g.number("profile_step_start") or 10, g.number("profile_step_end") or 12
        g.derive("profile", "ops.profile_steps", [first, last])
    for name in ("profile_step_start", "profile_step_end"):
        if name in g:
            if "profile" in g:
                g.needless(name, "part of ops.profile_steps")
            else:
                g.unmapped(name, "needs --profile")


def _derive_expert_bias(g: _Given) -> None:
    """Aux-loss-free balancing: an update rate only with the expert bias on."""
    if "moe_router_enable_expert_bias" in g:
        rate = BY_NAME["moe_router_enable_expert_bias"].value
        if "moe_router_bias_update_rate" in g:
            rate, why = _convert(BY_NAME["moe_router_bias_update_rate"], g.given["moe_router_bias_update_rate"])
            if why:
                g.unmapped("moe_router_bias_update_rate", why)
                rate = BY_NAME["moe_router_enable_expert_bias"].value
        g.derive("moe_router_enable_expert_bias", "model.moe_router_bias_update_rate", rate)
    elif "moe_router_bias_update_rate" in g:
        g.needless("moe_router_bias_update_rate", "no effect without --moe-router-enable-expert-bias")


def _megatron_defaults(t: Translation, given: dict[str, list[str]]) -> None:
    """Megatron's value for what the list leaves out, where megajax's default differs; and the model family."""
    keys = set(t.assignments)
    moe = bool(t.assignments.get("model.num_experts", (0,))[0])
    fp8 = t.assignments.get("train.precision", (None,))[0] == "fp8"
    for f in FLAGS:
        if f.default is _UNSET or f.key in keys or (f.when == "moe" and not moe) or (f.when == "fp8" and not fp8):
            continue
        t.assignments[f.key] = (f.default, f"Megatron's default (no {f.flag})")
        keys.add(f.key)
    activation = t.assignments.get("model.activation")
    exact = next((f"--{n.replace('_', '-')}" for n in ("no_bias_gelu_fusion", "disable_bias_linear") if n in given), None)
    if activation and activation[0] == "gelu_tanh" and activation[1].startswith("Megatron's default"):
        # validate_args turns the fusion off without biases; unfused, Megatron's GELU is torch's exact one
        t.assignments["model.activation"] = (("gelu", f"Megatron's unfused GELU ({exact}, no --swiglu)") if exact else
                                             ("gelu_tanh", "Megatron's fused bias-GELU (no --swiglu)"))
    impl = t.assignments.get("model.attention_impl")
    dropout = t.assignments.get("model.attention_dropout", (0.0,))[0]
    if impl and impl[0] in ("flash", "cudnn") and isinstance(dropout, float) and dropout > 0:
        # Megatron's flash and fused kernels apply attention dropout; megajax's kernels have none.
        t.assignments["model.attention_impl"] = ("xla", f"{impl[1]} with attention dropout {dropout:g}")
        t.unmapped.append((impl[1], f"megajax's {impl[0]} attention has no dropout, so attention dropout "
                                    f"{dropout:g} runs with the XLA attention; add --attention-dropout 0.0 to "
                                    f"keep the kernel"))
    if fp8 and "fp8_amax_compute_algo" not in given:
        t.unmapped.append(("(no --fp8-amax-compute-algo)", "Megatron's default most_recent; megajax scales by "
                                                           "the amax history's maximum"))
    if "model.ffn_hidden_size" not in t.assignments and isinstance(
            t.assignments.get("model.hidden_size", (None,))[0], int):
        hidden = t.assignments["model.hidden_size"][0]
        swiglu = t.assignments.get("model.activation", (None,))[0] == "swiglu"
        ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden
        t.assignments["model.ffn_hidden_size"] = (ffn, "Megatron's default (no --ffn-hidden-size)")
    position = t.assignments.get("model.position_embedding", (None,))[0]
    t.assignments["model.family"] = ("llama" if position == "rope" else "gpt", {
        "rope": "rotary positions", "none": "no position embedding"}.get(position, "learned positions"))


def markdown_table() -> str:
    """The table as docs/megatron-users.md shows it."""
    rows = ["| Megatron flag | megajax | note |", "|---|---|---|"]
    for f in FLAGS:
        if f.key is None:
            target = "nothing to set" if f.same or isinstance(f.value, dict) else "not mapped"
        elif f.takes == SWITCH and f.value is not None:
            target = f"`{f.key}={_text(f.value)}`"
        else:
            target = f"`{f.key}`"
        note = f.note
        if isinstance(f.value, dict) and f.key is not None:
            pairs = ", ".join(f"{k} -> {v}" for k, v in f.value.items() if v is not None)
            note = "; ".join(x for x in (pairs, note) if x)
        if f.default is not _UNSET:
            note = "; ".join(x for x in (note, f"absent: Megatron's {_text(f.default)}"
                                         + (f" ({'MoE' if f.when == 'moe' else 'FP8'} only)" if f.when else ""))
                             if x)
        rows.append(f"| `{f.flag}` | {target} | {note} |")
    return "\n".join(rows)

