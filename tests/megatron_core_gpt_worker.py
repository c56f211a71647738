"""Megatron-Core's GPTModel built from a Megatron-LM `args` Namespace the way Megatron-LM's training
script builds it (megatron.training.arguments.core_transformer_config_from_args, then pretrain_gpt.py's
model provider), on one CPU process over gloo; used by test_megatron_core_saves.py.

    python megatron_core_gpt_worker.py save ARGS.pt TOKENS.npy SAVE_DIR PORT
    python megatron_core_gpt_worker.py load STEP_DIR TOKENS.npy OUT.npy PORT

save: ARGS.pt holds the args (torch.save of the Namespace parse_args + validate_args made, plain values);
builds the model, initialised by megatron-core from args.seed and args.init_method_std, and writes
SAVE_DIR/iter_{args.iteration or 1:07d} with dist_checkpointing.save (common state `args`,
`checkpoint_version`, `iteration` in common.pt, as Megatron-LM writes a torch_dist save up to 0.18),
SAVE_DIR/latest_checkpointed_iteration.txt and SAVE_DIR/logits.npy, the model's logits on TOKENS
[batch, seq, padded vocab] in evaluation mode.

load: builds the model from a torch_dist step's own args (common.pt; a field they leave out takes
Megatron-LM's argparse default, as a run resuming from them with default flags would), loads it with
dist_checkpointing.load strictly and writes its logits on TOKENS to OUT.npy.

What the args decide, as Megatron-LM's builder passes them: layer sizes, norm and its epsilon, biases,
GELU / SwiGLU / squared ReLU, and bias_activation_fusion from bias_gelu_fusion (bias_swiglu_fusion with
SwiGLU): megatron-core's fused bias-GELU is the tanh approximation of GELU, its unfused GELU torch's exact
one; bias_dropout_fusion, masked_softmax_fusion, query-key layer scaling, softmax in fp32, the residual
after the norm, learned or rotary positions, tied or untied output. CPU stand-ins (the computed function
unchanged): the JIT fuser off (megatron's fused functions run eagerly instead of through torch.compile),
no persistent or apex layer norm, no RoPE or gradient-accumulation fusion, megatron's inference RNG
tracker (megatron_worker.init).
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist


def start(port):
    import megatron.core.jit as jit
    jit.disable_jit_fuser()  # before megatron.core.fusions is imported: its functions stay plain PyTorch
    from megatron_worker import init
    init(0, 1, port)


# Megatron-LM's argparse defaults for what build reads, for args that leave a field out (megajax's exports
# write the fields that describe the model; Megatron-LM takes the rest from its own command line).
MEGATRON_DEFAULTS = dict(
    swiglu=False, squared_relu=False, bias_gelu_fusion=True, bias_swiglu_fusion=True, bias_dropout_fusion=True,
    masked_softmax_fusion=True, apply_query_key_layer_scaling=False, attention_softmax_in_fp32=False,
    apply_residual_connection_post_layernorm=False, fp32_residual_connection=False, hidden_dropout=0.1,
    attention_dropout=0.1, init_method_std=0.02, qk_layernorm=False, group_query_attention=False, num_query_groups=1,
    normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=False, untie_embeddings_and_output_weights=False,
    position_embedding_type="learned_absolute", rotary_percent=1.0, rotary_base=10000, seed=1234)


def build(args):
    """GPTModel as Megatron-LM's pretrain_gpt.py builds it from `args` (local layer spec, fp32)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    def arg(name, older=None, default=None):  # megatron-core 0.19's args name some fields as TransformerConfig does
        for key in (name, older):
            if key is not None and getattr(args, key, None) is not None:
                return getattr(args, key)
        return MEGATRON_DEFAULTS.get(name, default)
    gated = bool(arg("swiglu"))
    activation = F.silu if gated else F.gelu
    fusion = arg("bias_swiglu_fusion") if gated else arg("bias_gelu_fusion")
    if arg("squared_relu"):
        from megatron.core.activations import squared_relu
        activation, fusion = squared_relu, False
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=arg("num_query_groups") if arg("group_query_attention") else None,
        kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size, normalization=arg("normalization"),
        layernorm_epsilon=arg("layernorm_epsilon", "norm_epsilon", 1e-5),
        layernorm_zero_centered_gamma=arg("layernorm_zero_centered_gamma", "apply_layernorm_1p", False),
        add_bias_linear=arg("add_bias_linear"), add_qkv_bias=arg("add_qkv_bias"), gated_linear_unit=gated,
        activation_func=activation, bias_activation_fusion=fusion, bias_dropout_fusion=arg("bias_dropout_fusion"),
        masked_softmax_fusion=arg("masked_softmax_fusion"),
        apply_query_key_layer_scaling=arg("apply_query_key_layer_scaling"),
        attention_softmax_in_fp32=arg("attention_softmax_in_fp32"),
        apply_residual_connection_post_layernorm=arg("apply_residual_connection_post_layernorm"),
        fp32_residual_connection=arg("fp32_residual_connection"), hidden_dropout=arg("hidden_dropout"),
        attention_dropout=arg("attention_dropout"), init_method_std=arg("init_method_std"),
        qk_layernorm=arg("qk_layernorm"), tensor_model_parallel_size=1, use_cpu_initialization=True,
        params_dtype=torch.float32, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False)
    torch.manual_seed(arg("seed"))
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=arg("normalization"),
                                                                        qk_layernorm=arg("qk_layernorm")),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        parallel_output=False, share_embeddings_and_output_weights=not arg("untie_embeddings_and_output_weights"),
        position_embedding_type=arg("position_embedding_type"), rotary_percent=arg("rotary_percent"),
        rotary_base=arg("rotary_base"))


def logits(model, tokens_file, out_file):
    tokens = torch.from_numpy(np.load(tokens_file)).long()
    b, l = tokens.shape
    positions = torch.arange(l)[None].expand(b, l)
    mask = torch.triu(torch.ones(l, l, dtype=torch.bool), 1)[None, None]  # True: masked out
    with torch.no_grad():
        np.save(out_file, model.eval()(tokens, positions, mask).float().numpy())


def save(args_file, tokens_file, save_dir, port):
    start(port)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    args = torch.load(args_file, weights_only=False)
    model = build(args)
    iteration = int(getattr(args, "iteration", 0) or 1)
    step = os.path.join(save_dir, f"iter_{iteration:07d}")
    os.makedirs(step)
    state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": iteration}
    dist_checkpointing.save(state, step, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    logits(model, tokens_file, os.path.join(save_dir, "logits.npy"))


def load(step, tokens_file, out_file, port):
    start(port)
    from megatron.core import dist_checkpointing
    args = dist_checkpointing.load_common_state_dict(step)["args"]
    model = build(args)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, step)
    model.load_state_dict(state["model"], strict=True)
    logits(model, tokens_file, out_file)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "save":
        save(rest[0], rest[1], rest[2], int(rest[3]))
    else:
        load(rest[0], rest[1], rest[2], int(rest[3]))
    import multiprocessing
    for child in multiprocessing.active_children():  # dist_checkpointing's writer process, else orphaned
        child.terminate()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
