"""Peer baselines on the same machine: the same model trained by Hugging Face `transformers`
(PyTorch) or by Megatron-Core, timed step by step.

Same sizes, batch, sequence, precision and optimizer (AdamW); random token
batches; the device is the one megajax runs on (CPU here, CUDA on a GPU).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable, MutableMapping

from megajax.config import Config
from megajax.errors import ConfigError

# Environment variables with which the user already chose how JAX takes GPU memory.
JAX_GPU_MEMORY_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _nvidia_gpus(environ: MutableMapping[str, str]) -> int:
    """NVIDIA GPUs this process can see, without initialising CUDA (the driver's /proc entries)."""
    from megajax.distributed import visible_accelerators
    if not os.path.isdir("/proc/driver/nvidia/gpus"):
        return 0
    return visible_accelerators(environ) or 0


def share_gpu_with_torch(environ: MutableMapping[str, str] | None = None) -> bool:
    """Keeps JAX from preallocating 75% of GPU memory, which a PyTorch baseline in the same process
    then lacks: sets XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX allocates as it needs) unless the
    user chose a JAX memory setting. Effective only before JAX initialises its GPU backend.
    Returns whether it changed the environment."""
    environ = os.environ if environ is None else environ
    if any(k in environ for k in JAX_GPU_MEMORY_ENV):
        return False
    environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        from jax._src import xla_bridge
        late = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        late = False
    if late:
        print("megajax bench: JAX's backend is already initialised, so XLA_PYTHON_CLIENT_PREALLOCATE=false "
              "does not apply in this process; set it in the environment when a baseline shares the GPU.",
              file=sys.stderr)
    return True


def check_baseline(name: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Fails before megajax builds or times anything when the baseline cannot run here, and leaves
    GPU memory for it. Imports nothing heavy (importing torch first could load its CUDA libraries
    before JAX's)."""
    environ = os.environ if environ is None else environ
    if name not in BASELINES:
        raise ConfigError(f"--baseline {name!r}: accepted values are {', '.join(BASELINES)}.")
    gpus = _nvidia_gpus(environ)
    if name == "torch":
        missing = [m for m in ("torch", "transformers") if not _installed(m)]
        if missing:
            raise ConfigError(f"--baseline torch needs {' and '.join(missing)} (pip install 'megajax[torch]').")
    else:
        missing = [m for m in ("torch", "megatron.core") if not _installed(m)]
        if missing:
            raise ConfigError(f"--baseline megatron needs {' and '.join(missing)} (pip install megatron-core "
                              f"torch); without them use --baseline torch.")
        if not gpus:
            raise ConfigError("--baseline megatron runs Megatron-Core on an NVIDIA GPU with CUDA; this machine "
                              "shows none (no /proc/driver/nvidia/gpus, or CUDA_VISIBLE_DEVICES hides them). "
                              "Use --baseline torch, which runs on the CPU too.")
    if gpus:
        share_gpu_with_torch(environ)


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("--baseline torch needs PyTorch and transformers (pip install 'megajax[torch]').") from None
    return torch


def torch_dtype(torch, cfg: Config):
    """The baseline's compute dtype: the precision policy's (an fp8 run is measured against the
    peers in bf16: FP8 in PyTorch needs Transformer Engine, which the baselines do not use)."""
    from megajax.precision.policy import precision_policy
    return getattr(torch, precision_policy(cfg).compute_dtype.name)


def hf_model(cfg: Config, torch):
    """The Hugging Face model with megajax's architecture (random init)."""
    import transformers
    m = cfg.model
    if m.family == "llama":
        rope = None
        if m.rope_scaling == "llama3":
            rope = {"rope_type": "llama3", "factor": m.rope_scaling_factor, "low_freq_factor": m.rope_low_freq_factor,
                    "high_freq_factor": m.rope_high_freq_factor,
                    "original_max_position_embeddings": m.rope_original_max_position}
        hf = transformers.LlamaConfig(
            vocab_size=m.padded_vocab_size(), hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
            head_dim=m.head_dim, max_position_embeddings=max(m.max_position_embeddings, cfg.train.seq_len),
            rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, rope_scaling=rope,
            tie_word_embeddings=m.tie_embeddings, attention_bias=m.use_bias, mlp_bias=m.use_bias)
        model = transformers.LlamaForCausalLM(hf)
    else:
        hf = transformers.GPT2Config(
            vocab_size=m.padded_vocab_size(), n_embd=m.hidden_size, n_layer=m.num_layers, n_head=m.num_heads,
            n_inner=m.ffn_hidden_size, n_positions=m.max_position_embeddings, activation_function="gelu",
            resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
            layer_norm_epsilon=m.norm_eps)
        model = transformers.GPT2LMHeadModel(hf)
    try:
        model.config._attn_implementation = "sdpa"
    except Exception:
        pass
    return model


def torch_train_step(cfg: Config) -> tuple[Callable[[], None], str]:
    """(one training step, device description) for the Hugging Face model."""
    torch = _torch()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.train.seed)
    dtype = torch_dtype(torch, cfg)
    model = hf_model(cfg, torch).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                            eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    b, s = cfg.train.global_batch, cfg.train.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), device=device)
    micro = cfg.train.micro_batch or b
    autocast = dtype in (torch.bfloat16, torch.float16)
    scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None

    def step() -> None:
        for i in range(0, b, micro):
            x = tokens[i:i + micro]
            with torch.autocast(device_type=device, dtype=dtype, enabled=autocast):
                out = model(input_ids=x[:, :-1], labels=x[:, 1:])
            loss = out.loss * (micro / b)
            (scaler.scale(loss) if scaler else loss).backward()
        if cfg.optim.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    return step, f"transformers {model.__class__.__name__} on torch {torch.__version__} ({device}, "\
                 f"{torch.get_num_threads()} threads)"


def megatron_train_step(cfg: Config) -> tuple[Callable[[], None], str]:
    """(one training step, description) for Megatron-Core's GPTModel (local layer spec, GPU only)."""
    torch = _torch()
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        raise ConfigError("--baseline megatron needs megatron-core (pip install megatron-core).") from None
    if not torch.cuda.is_available():
        raise ConfigError("--baseline megatron runs on a CUDA GPU; this machine has none (use --baseline torch).")
    import os
    import torch.distributed as dist
    m = cfg.model
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    dtype = torch_dtype(torch, cfg)
    tc = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        num_query_groups=m.num_kv_heads, ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.head_dim,
        normalization="RMSNorm" if m.norm == "rmsnorm" else "LayerNorm", gated_linear_unit=m.activation == "swiglu",
        activation_func=torch.nn.functional.silu if m.activation == "swiglu" else torch.nn.functional.gelu,
        add_bias_linear=m.use_bias, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, recompute_granularity=None if cfg.parallel.recompute == "none" else cfg.parallel.recompute,
        recompute_method="uniform" if cfg.parallel.recompute == "full" else None,
        recompute_num_layers=1 if cfg.parallel.recompute == "full" else None, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=m.padded_vocab_size(), max_sequence_length=cfg.train.seq_len,
                     position_embedding_type="rope" if m.position_embedding == "rope" else "learned_absolute",
                     rotary_base=int(m.rope_theta), share_embeddings_and_output_weights=m.tie_embeddings).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, fused=True)
    b, s = cfg.train.global_batch, cfg.train.seq_len
    micro = cfg.train.micro_batch or b
    tokens = torch.randint(0, m.vocab_size, (b, s + 1), device="cuda")
    pos = torch.arange(s, device="cuda")[None].expand(micro, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device="cuda"), 1)[None, None]

    def step() -> None:
        for i in range(0, b, micro):
            x = tokens[i:i + micro]
            loss = model(x[:, :-1], pos, mask, labels=x[:, 1:]).float().mean() * (micro / b)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    return step, "megatron-core GPTModel (local spec) on torch " + torch.__version__


BASELINES = {"torch": torch_train_step, "megatron": megatron_train_step}
