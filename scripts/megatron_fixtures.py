"""Writes the Megatron-Core checkpoints that tests/test_megatron_releases.py imports, with the
release's own code: `megatron.training.arguments.parse_args` + `validate_args` (the full `args`
Namespace every `pretrain_gpt.py` run stores), GPTModel built from
`core_transformer_config_from_args` as `pretrain_gpt.py`'s model provider builds it, and
`megatron.training.checkpointing.save_checkpoint` (torch_dist through `dist_checkpointing.save`,
or the legacy torch format), at tensor parallel 2 on two CPU processes over gloo. Each case's
directory also gets `tokens.npy` and `logits.npy`: megatron-core's full-vocabulary logits of the
saved model on those tokens, and `release.json` (the megatron-core and torch versions).

Run it in a side environment with the release (megatron-core 0.19 declares Python >= 3.12 but runs
on 3.11 installed without its dependency checks):

    python3 -m venv /tmp/mcore && /tmp/mcore/bin/pip install torch==2.13.0 'numpy<2.5' psutil packaging einops
    /tmp/mcore/bin/pip install --no-deps --ignore-requires-python megatron-core==0.19.2
    /tmp/mcore/bin/python scripts/megatron_fixtures.py --output tests/fixtures/megatron_core_0_19

It never imports megajax. `--check-export DIR` instead loads a megajax torch_dist export (DIR, one
tensor rank) with the release's `dist_checkpointing.load` strictly into the GPTModel its saved args
describe and prints the logits' largest difference from `DIR/../logits.npy` when that file is there.

CPU workarounds (megatron-core assumes CUDA in a few places): the CUDA RNG calls return the CPU
generator's state, RoPE's device lookup answers "cpu", and the RNG tracker is megatron's inference
tracker (its fork is a null context).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SEQ = 16
VOCAB = 200  # NullTokenizer's vocab: padded to 256 (128 x TP 2) by Megatron
ITERATION = 10
COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ),
          "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "2",
          "--train-iters", str(ITERATION), "--lr", "1e-3", "--save-interval", str(ITERATION),
          "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--transformer-impl", "local",
          "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
          "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
          "--no-persist-layer-norm", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
          "--seed", "1234", "--init-method-std", "0.05"]
# GPT-2 style: LayerNorm, GELU, biases, learned positions, tied embeddings
GPT = ["--ffn-hidden-size", "128", "--position-embedding-type", "learned_absolute"]
# Llama style (RMSNorm, SwiGLU, RoPE, GQA, untied, no biases) with SequentialMLP experts (the allgather
# dispatcher runs on CPU)
MOE = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
       "--num-query-groups", "2", "--ffn-hidden-size", "96", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "allgather",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"]
TP2 = ["--tensor-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]  # and data parallel 2: the dense weights on both ranks
FIXTURES = {  # name: the pretrain_gpt.py arguments (2 processes)
    "gpt-tp2-torch_dist": COMMON + GPT + TP2 + ["--ckpt-format", "torch_dist"],
    "moe-tp2-torch_dist": COMMON + MOE + TP2 + ["--ckpt-format", "torch_dist"],
    "gpt-tp2-torch": COMMON + GPT + TP2 + ["--ckpt-format", "torch"],
    "moe-ep2-torch": COMMON + MOE + EP2 + ["--ckpt-format", "torch"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_3_11_workarounds():
    """megatron-core 0.19 declares Python 3.12 for typing.override alone (a decorator that returns its
    argument)."""
    import typing
    if not hasattr(typing, "override"):
        typing.override = lambda f: f


def cpu_workarounds():
    import torch
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    import megatron.core.transformer.moe.moe_utils as moe_utils
    moe_utils.te_general_gemm = None
    import megatron.training.arguments as arguments  # its CUDA_DEVICE_MAX_CONNECTIONS advice asks the GPU
    arguments.get_device_arch_version = lambda: 9
    import megatron.training.checkpointing as checkpointing  # it agrees on the iteration over CUDA tensors

    def read_metadata(tracker):
        text = Path(tracker).read_text().strip()
        return (0, True) if text == "release" else (int(text), False)
    checkpointing.read_metadata = read_metadata


def megatron_args(argv: list[str]):
    """The release's args for `argv`, as pretrain_gpt.py's initialisation parses and validates them."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args()
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=True)
    return args


def build(args):
    """GPTModel as pretrain_gpt.py's model provider builds it with the local spec."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.training.arguments import core_transformer_config_from_args
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                             expert_model_parallel_size=args.expert_model_parallel_size)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(args.seed)
    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                                    qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                    fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base)


def logits(model, tokens):
    """The full-vocabulary logits [batch, seq, padded vocab] (the vocab shards gathered)."""
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    b, l = tokens.shape
    positions = torch.arange(l)[None].expand(b, l)
    mask = torch.triu(torch.ones(l, l, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        out = model.eval()(tokens, positions, mask)
    return gather_from_tensor_model_parallel_region(out).float()


def rank_main(name: str, out: str, rank: int, port: int):
    import numpy as np
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    python_3_11_workarounds()
    cpu_workarounds()
    save = Path(out) / name
    args = megatron_args(FIXTURES[name] + ["--save", str(save)])
    model = build(args)
    from megatron.training.checkpointing import save_checkpoint
    save_checkpoint(ITERATION, [model], None, None, 0)
    tokens = torch.from_numpy(np.random.default_rng(7).integers(0, VOCAB, (2, SEQ))).long()
    got = logits(model, tokens)
    if rank == 0:
        import megatron.core
        np.save(save / "tokens.npy", tokens.numpy())
        np.save(save / "logits.npy", got.numpy())
        (save / "release.json").write_text(json.dumps({
            "megatron_core": megatron.core.__version__, "torch": torch.__version__.split("+")[0],
            "args_fields": len(vars(args)), "argv": FIXTURES[name]}, indent=1) + "\n")
    dist.barrier()


def check_export(export: str, rank: int, world: int, port: int, tensor_parallel: int):
    """Loads a megajax export as `pretrain_gpt.py --load EXPORT --use-checkpoint-args` does: the model's
    args from the checkpoint (load_args_from_checkpoint), validate_args, GPTModel from them, and
    load_checkpoint with strict loading (`--dist-ckpt-strictness raise_all` for torch_dist); rank 0 prints
    a JSON line: the iteration loaded and, when EXPORT/../logits.npy and tokens.npy are there (the
    exporter's own logits), the largest difference of megatron-core's logits from them."""
    import numpy as np
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    python_3_11_workarounds()
    cpu_workarounds()
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_args_from_checkpoint, load_checkpoint
    from megatron.training.global_vars import set_global_variables
    sys.argv = ["pretrain_gpt.py", "--load", export, "--use-checkpoint-args", "--micro-batch-size", "1",
                "--tensor-model-parallel-size", str(tensor_parallel), "--no-load-optim", "--no-load-rng",
                "--dist-ckpt-strictness", "raise_all", "--transformer-impl", "local", "--use-cpu-initialization",
                "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "1", "--exit-on-missing-checkpoint"]
    args = parse_args()
    load_args_from_checkpoint(args)
    saved = Path(export)
    vocab = None
    if (saved / "tokens.npy").is_file():
        vocab = int(np.load(saved / "logits.npy").shape[-1])
        args.vocab_size = vocab  # NullTokenizer's size: the exporter's real vocabulary
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=True)
    model = build(args)
    iteration, _ = load_checkpoint([model], None, None, strict=True)
    report = {"iteration": iteration, "loaded_strictly": True}
    if vocab is not None:
        tokens = torch.from_numpy(np.load(saved / "tokens.npy")).long()
        got = logits(model, tokens).numpy()[..., :vocab]
        report["max_abs_logit_diff"] = float(np.abs(got - np.load(saved / "logits.npy")).max())
    if rank == 0:
        print(json.dumps(report), flush=True)
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="tests/fixtures/megatron_core")
    p.add_argument("--fixtures", nargs="*", default=list(FIXTURES), choices=list(FIXTURES))
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--check-export", metavar="DIR",
                   help="instead: load a megajax export (DIR, its save directory) as pretrain_gpt.py does")
    p.add_argument("--tensor-parallel", type=int, default=1, help="with --check-export: the TP to load it at")
    a = p.parse_args()
    if a.check_export and a.rank is not None:
        return check_export(a.check_export, a.rank, a.tensor_parallel, a.port, a.tensor_parallel)
    if a.rank is not None:
        return rank_main(a.fixtures[0], a.output, a.rank, a.port)
    if a.check_export:
        port, env = free_port(), dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--check-export", a.check_export, "--tensor-parallel",
                                   str(a.tensor_parallel), "--rank", str(r), "--port", str(port)], env=env)
                 for r in range(a.tensor_parallel)]
        sys.exit(max(proc.wait() for proc in procs))
    Path(a.output).mkdir(parents=True, exist_ok=True)
    for name in a.fixtures:
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--output", a.output, "--fixtures", name,
                                   "--rank", str(r), "--port", str(port)], env=env) for r in range(2)]
        codes = [proc.wait() for proc in procs]
        if any(codes):
            sys.exit(f"{name}: the ranks exited with {codes}")
        print(f"wrote {Path(a.output) / name}")


if __name__ == "__main__":
    main()
