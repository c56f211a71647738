"""What Megatron-LM itself refuses in a `pretrain_gpt.py` argument list (megatron-core 0.16's
`parse_args` and `validate_args`), for `megajax config from-megatron`: a list Megatron would not
start with is not translated either.

    refusal(name, takes, values)  why Megatron's argparse refuses the words after one flag (their count,
                                  type, or choice: CHOICES), or None
    conflicts(given)              [(flags, why)]: the combinations validate_args asserts against

`given` maps Megatron's argparse names (num_layers) to the words after the flag, as
megajax/megatron_args.py splits a list. Words left as shell variables ($NUM_LAYERS) are not judged.
This module imports nothing from megajax.
"""

from __future__ import annotations

# How a flag's values are read: one value of a type, a list, or none (a switch).
INT, FLOAT, STR, LIST, SWITCH = "int", "float", "str", "list", "switch"

CHOICES: dict[str, tuple[str, ...]] = {
    "normalization": ("LayerNorm", "RMSNorm"),
    "position_embedding_type": ("learned_absolute", "rope", "mrope", "relative", "none"),
    "attention_backend": ("flash", "fused", "unfused", "local", "auto"),
    "transformer_impl": ("local", "transformer_engine", "inference_optimized"),
    "moe_router_score_function": ("softmax", "sigmoid"),
    "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
    "moe_token_dispatcher_type": ("allgather", "alltoall", "flex"),
    "recompute_granularity": ("full", "selective"),
    "recompute_method": ("uniform", "block"),
    "distributed_backend": ("nccl", "gloo"),
    "fp8_format": ("e4m3", "hybrid"),
    "fp8_recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    "fp8_amax_compute_algo": ("most_recent", "max"),
    "lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    "optimizer": ("adam", "sgd", "muon", "dist_muon"),
    "ckpt_format": ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor", "zarr"),
    "empty_unused_memory_level": ("0", "1", "2"),
    "tokenizer_type": ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                       "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                       "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"),
}

# Flags with nargs: '*' / '+' (or a fixed count), whose several values are no error.
NARGS = {"data_path": "*", "cp_comm_type": "+", "moe_router_load_balancing_type": "+", "moe_aux_loss_coeff": "+",
         "rampup_batch_size": 3}


def placeholder(value: str) -> bool:
    """A shell variable left unexpanded ($NUM_LAYERS): the launch script's value, not judged here."""
    return "$" in value


def refusal(name: str, takes: str, values: list[str]) -> str | None:
    """Why Megatron's argparse refuses `values`, the words after the flag named `name` (read as `takes`):
    a count, a type or a choice; None when it takes them."""
    nargs = NARGS.get(name)
    if takes == SWITCH:
        return (f"a switch takes no value; given {' '.join(values)} (argparse: unrecognized arguments)"
                if values else None)
    if not values and nargs != "*":
        return "no value given (argparse: expected one argument)"
    if nargs is None and len(values) > 1:
        return (f"one value, given {len(values)}: {' '.join(values)} (argparse: unrecognized arguments: "
                f"{' '.join(values[1:])})")
    if nargs == 3 and len(values) != 3:
        return f"three values (start, increment, samples), given {len(values)}: {' '.join(values)}"
    kind = INT if name == "rampup_batch_size" else takes
    for raw in (v for v in values if not placeholder(v)):
        if name == "moe_layer_freq":
            if not (raw.lstrip("-").isdigit() or ("[" in raw and set(raw) <= set("0123456789,[]()+*"))):
                return f"{raw!r} is neither an integer nor a list pattern such as '([0]*3+[1]*29)'"
            continue
        try:
            {INT: int, FLOAT: float}.get(kind, str)(raw)
        except ValueError:
            return (f"{raw!r} is not {'an integer' if kind == INT else 'a number'} (argparse: invalid "
                    f"{'int' if kind == INT else 'float'} value)")
        if name in CHOICES and raw not in CHOICES[name]:
            return f"{raw!r} is not one of Megatron's choices: {', '.join(CHOICES[name])}"
    return None


def _int(given: dict[str, list[str]], name: str) -> int | None:
    """The flag's integer value; None when absent, a shell variable or not an integer."""
    try:
        return int(given[name][0])
    except (KeyError, IndexError, ValueError):
        return None


def _set(given: dict[str, list[str]], name: str) -> bool:
    """The flag is given with a value other than Megatron's default 0 (or as a switch)."""
    return name in given and (not given[name] or given[name][0] not in ("0", "0.0"))


def conflicts(given: dict[str, list[str]]) -> list[tuple[str, str]]:
    """The combinations Megatron's validate_args asserts against: [(the flags, why, with Megatron's words)]."""
    out = []

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    def both(a: str, b: str, why: str) -> None:
        if _set(given, a) and _set(given, b):
            out.append((f"{flag(a)} with {flag(b)}", why))

    both("fp16", "bf16", "one parameter dtype or the other (validate_args: assert not args.bf16); keep one")
    for other in ("train_samples", "lr_decay_samples", "lr_warmup_samples", "rampup_batch_size"):
        both("train_iters", other, "iteration-based training takes iteration counts only ('expected iteration-based "
                                   "training'); give counts in iterations, or --train-samples and samples")
    for other in ("lr_decay_iters", "lr_warmup_iters"):
        both("train_samples", other, "sample-based training takes sample counts only ('expected sample-based "
                                     "training'); give counts in samples, or --train-iters and iterations")
    for other in ("lr_warmup_iters", "lr_warmup_samples"):
        both("lr_warmup_fraction", other, "one way to give the warmup ('can only specify one of lr-warmup-fraction "
                                          "and ...')")
    if given.get("recompute_granularity") == ["selective"] and "recompute_method" in given:
        out.append(("--recompute-method with --recompute-granularity selective",
                    "'recompute method is not yet supported for selective recomputing granularity'; drop "
                    "--recompute-method (it chooses the layers of full recompute)"))
    if "save" in given and "save_interval" not in given:
        out.append(("--save without --save-interval", "Megatron saves every --save-interval iterations and asserts "
                                                      "that it is given with --save"))
    seq, positions = _int(given, "seq_length"), _int(given, "max_position_embeddings")
    if seq is not None and positions is not None and positions < seq:
        out.append((f"--seq-length {seq} with --max-position-embeddings {positions}",
                    f"max_position_embeddings ({positions}) must be greater than or equal to seq_length ({seq})"))
    out += _layout_conflicts(given)
    return out


def _layout_conflicts(given: dict[str, list[str]]) -> list[tuple[str, str]]:
    """Expert parallelism against the experts, the virtual pipeline against the layers."""
    out = []
    ep, experts = _int(given, "expert_model_parallel_size"), _int(given, "num_experts")
    if ep is not None and ep > 1 and "num_experts" not in given:
        out.append((f"--expert-model-parallel-size {ep} without --num-experts",
                    "'num_experts must be non None to use expert model parallelism'"))
    elif ep and experts is not None and experts % ep:
        out.append((f"--expert-model-parallel-size {ep} with --num-experts {experts}",
                    f"'Number of experts should be a multiple of expert model parallel_size'; accepted sizes: "
                    f"{', '.join(str(d) for d in range(1, experts + 1) if experts % d == 0)}"))
    per_chunk, layers = _int(given, "num_layers_per_virtual_pipeline_stage"), _int(given, "num_layers")
    pp = _int(given, "pipeline_model_parallel_size") or 1
    if per_chunk is not None and layers is not None and per_chunk > 0:
        if layers % pp or (layers // pp) % per_chunk:
            out.append((f"--num-layers-per-virtual-pipeline-stage {per_chunk} with --num-layers {layers} and "
                        f"--pipeline-model-parallel-size {pp}",
                        f"each of the {pp} stages holds num_layers / {pp} layers, which must be a whole multiple of "
                        f"{per_chunk} ('number of layers per pipeline stage must be divisible number of layers per "
                        f"virtual pipeline stage')"))
    return out
