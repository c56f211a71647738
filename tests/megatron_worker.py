"""One tensor-parallel rank of Megatron-Core's own GPTModel, run on CPU over gloo (used by test_export.py).

    python megatron_worker.py STEP_DIR TOKENS.npy OUT.npy RANK WORLD PORT [SAVE_DIR]

Builds GPTModel with the local (non Transformer Engine) layer spec from the
checkpoint's saved `args`, one model per pipeline stage, loads this rank's
files with load_state_dict(strict=True), runs the stages one after another
(a pipeline done by hand, handing each stage's hidden states to the next) and,
on rank 0, saves the full-vocabulary logits [batch, seq, padded vocab]. WORLD is the tensor-parallel
size times the expert-parallel one (args.expert_model_parallel_size: each process loads its tensor
and expert rank's file, `mp_rank_TT[_PPP]_EEE`). With SAVE_DIR every process also writes its models'
state dicts back as a legacy checkpoint there (SAVE_DIR/iter_0000001/<its rank folder>), for the
importer to read back.

A mixture-of-experts checkpoint (args.num_experts) gets the local spec's MoE layer (SequentialMLP
experts, the allgather token dispatcher; SharedExpertMLP when args name a shared expert).
Multi-latent attention (args.multi_latent_attention) gets MLATransformerConfig and MLASelfAttention;
multi-token prediction (args.mtp_num_layers) a MultiTokenPredictionBlock on the last stage, its layer
built as pretrain_gpt.py builds it, like the decoder's last layer (MTP_DENSE=1 in the environment: a
dense local-spec layer), whose logits (the output layer's on each depth, caught by a hook; GPTModel
runs the depths only with labels) are saved beside the logits as OUT_mtp.npy
[depths, batch, seq, padded vocab].

Megatron-Core assumes CUDA in places that a CPU run must work around:
- the RNG tracker: `initialize_rng_tracker(inference_rng_tracker=True)` installs
  megatron's own no-op tracker (its `fork()` is a null context), so no CUDA RNG
  state is created or forked;
- RoPE: RotaryEmbedding.get_emb moves `inv_freq` to `torch.cuda.current_device()`
  on first use; pointing that function at "cpu" keeps it on the CPU;
- the MoE router calls Transformer Engine's GEMM when its module imported one: set to None;
- multi-latent attention builds its core attention with k_channels / v_channels, which only Transformer
  Engine's takes: the local DotProductAttention (whose products already take q/k and v of other head
  dims, and MLA's softmax scale as given) is let take them, its output width set to heads x v_channels.
"""

import glob
import os
import sys

import numpy as np
import torch
import torch.distributed as dist


def main(step_dir, tokens_file, out_file, rank, world, port, save_dir=None):
    first = sorted(glob.glob(os.path.join(step_dir, "mp_rank_00*", "model_optim_rng.pt")))[0]
    args = torch.load(first, weights_only=False)["args"]
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    # Expert tensor size 1 below the tensor size (MoE parallel folding): the expert group spans the tensor ranks.
    assert (tp * ep if etp == tp else ep) == world, (tp, ep, etp, world)
    init(rank, world, port, tp, ep, etp)
    from megatron.core import parallel_state
    t, e = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()

    def rank_folder(stage):
        return f"mp_rank_{t:02d}" + (f"_{stage:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")

    stages = []
    for s in range(pp):
        model = build_model(args, tp, pp, s, ep, etp)
        state = torch.load(os.path.join(step_dir, rank_folder(s), "model_optim_rng.pt"), weights_only=False)["model"]
        state = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        model.load_state_dict(state, strict=True)
        stages.append(model.eval())
        if save_dir:
            path = os.path.join(save_dir, "iter_0000001", rank_folder(s), "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": model.state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": 1}, path)
    if save_dir and rank == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    save_logits(stages, tokens_file, out_file, rank)


def init(rank, world, port, tp=None, ep=1, etp=None):
    """A gloo process group of `world` CPU processes and megatron-core's parallel state (TP x EP = world, or
    EP = world with expert tensor size `etp` 1; TP = world by default)."""
    tp = tp or world // ep
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing's save calls it unconditionally


def build_model(args, tp, pp, s, ep=1, etp=None):
    """Megatron-Core's GPTModel for pipeline stage s of the architecture `args` describe (local spec, fp32)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    moe = {}
    if getattr(args, "num_experts", None):
        import megatron.core.transformer.moe.moe_utils as moe_utils
        moe_utils.te_general_gemm = None
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_token_dispatcher_type="allgather",
                   moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None),
                   moe_shared_expert_gate=getattr(args, "moe_shared_expert_gate", False),
                   moe_router_score_function=getattr(args, "moe_router_score_function", "softmax"),
                   moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
                   moe_router_enable_expert_bias=getattr(args, "moe_router_enable_expert_bias", False),
                   moe_router_bias_update_rate=getattr(args, "moe_router_bias_update_rate", None) or 1e-3,
                   moe_layer_freq=getattr(args, "moe_layer_freq", None) or 1,
                   moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
                   moe_router_group_topk=getattr(args, "moe_router_group_topk", None),
                   moe_router_pre_softmax=getattr(args, "moe_router_pre_softmax", False))

    mla = {}
    config_class = TransformerConfig
    if getattr(args, "multi_latent_attention", False):
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        config_class = MLATransformerConfig
        mla = {k: getattr(args, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                            "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale",
                                            "mscale_all_dim")}
        mla.update({k: getattr(args, k) for k in ("beta_fast", "beta_slow", "original_max_position_embeddings")
                    if hasattr(args, k)})
        mla.update(rotary_base=args.rotary_base)
        local_core_attention_takes_mla_head_dims()
    if getattr(args, "mtp_num_layers", None):
        mla.update(mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    config = config_class(
        num_layers=args.num_layers // pp, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
        use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        qk_layernorm=getattr(args, "qk_layernorm", False),
        gradient_accumulation_fusion=False, **moe, **mla)
    local_spec = dict(normalization=args.normalization, qk_layernorm=getattr(args, "qk_layernorm", False),
                      multi_latent_attention=getattr(args, "multi_latent_attention", False))
    if moe.get("moe_layer_freq", 1) != 1:  # dense layers between the MoE ones: megatron-core's block spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        assert pp == 1, "the worker builds interleaved dense layers on one pipeline stage"
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                normalization=args.normalization)
    else:
        layer_spec = get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"), moe_grouped_gemm=False,
                                              **local_spec)
    mtp_spec = None
    if getattr(args, "mtp_num_layers", None) and s == pp - 1:  # on the last stage, as pretrain_gpt.py places it
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        # pretrain_gpt.py's: the decoder's spec, whose last layer the depths' layer is built like (a
        # mixture of experts for DeepSeek-V3); MTP_DENSE=1 builds it dense (an export whose depths are)
        mtp_layer = (get_gpt_layer_local_spec(**local_spec) if os.environ.get("MTP_DENSE") == "1" else layer_spec)
        mtp_spec = get_gpt_mtp_block_spec(config, mtp_layer, use_transformer_engine=False)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=s == 0, post_process=s == pp - 1, parallel_output=False,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor, mtp_block_spec=mtp_spec)
    if getattr(args, "mtp_num_layers", None) and s < pp - 1:
        # With MTP megatron-core puts the final norm on the stage holding the model's last layer (its
        # layer_number == num_layers). Each stage here is a model of its own layers (num_layers / pp),
        # so every stage would build one: the stages before the last hold none, as in a pipelined run.
        model.decoder.final_layernorm = None
    return model


def local_core_attention_takes_mla_head_dims():
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    if not isinstance(mla.TELinear, type):  # None, or a stand-in without Transformer Engine
        mla.HAVE_TE = False
    if getattr(DotProductAttention, "takes_mla_head_dims", False):
        return
    init = DotProductAttention.__init__

    def patched(self, *args, k_channels=None, v_channels=None, **kwargs):
        init(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    DotProductAttention.__init__, DotProductAttention.takes_mla_head_dims = patched, True


def save_logits(stages, tokens_file, out_file, rank):
    """Runs the stages one after another on the tokens; rank 0 saves the logits."""
    tokens = torch.from_numpy(np.load(tokens_file)).long()
    b, l = tokens.shape
    positions = torch.arange(l)[None].expand(b, l)
    mask = torch.triu(torch.ones(l, l, dtype=torch.bool), 1)[None, None]  # True: masked out
    mtp, caught = getattr(stages[-1], "mtp_process", False), []
    if mtp:  # the output layer runs on each depth's hidden states, then on the model's
        # a copy: the loss GPTModel computes from them shifts the logits in place
        stages[-1].output_layer.register_forward_hook(lambda module, inputs, out: caught.append(out[0].clone()))
    with torch.no_grad():
        hidden = None
        for s, model in enumerate(stages):
            if s > 0:
                model.set_input_tensor(hidden)
            hidden = model(tokens, positions, mask, labels=tokens if mtp else None)
    if mtp:
        hidden = caught[-1].transpose(0, 1)
    if rank == 0:
        np.save(out_file, hidden.float().numpy())
        if mtp:
            np.save(out_file[:-len(".npy")] + "_mtp.npy",
                    torch.stack([x.transpose(0, 1) for x in caught[:-1]]).float().numpy())
    dist.barrier()  # every rank is done with the collectives before any leaves


if __name__ == "__main__":
    step, toks, out, rank, world, port, *save = sys.argv[1:]
    main(step, toks, out, int(rank), int(world), int(port), *save)
    # Leave without running C++ destructors: tearing down gloo's threads at exit aborted once in CI
    # ("terminate called without an active exception", status -6) after the logits were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
