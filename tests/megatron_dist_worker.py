"""One tensor-parallel rank of Megatron-Core's GPTModel saving or loading a torch_dist checkpoint with
megatron-core's own dist_checkpointing, on CPU over gloo (used by test_torch_dist.py).

    python megatron_dist_worker.py save TOKENS.npy RANK WORLD PORT LEGACY_STEP_DIR SAVE_DIR [LEGACY SAVE ...]
        [--step STEP_DIR OUT_DIR LR]   (WORLD 1: then `step` below, in the same process)
    python megatron_dist_worker.py load STEP_DIR TOKENS.npy OUT.npy RANK WORLD PORT

save: for each pair, builds GPTModel (local spec) from a legacy checkpoint's args at TP = WORLD, loads
that rank's legacy file, saves its logits on TOKENS as SAVE_DIR/logits.npy and writes SAVE_DIR/iter_{iteration:07d} with dist_checkpointing.save (the common
state `args`, `checkpoint_version`, `iteration` going to common.pt, as Megatron-LM up to
megatron-core 0.18 writes it) and SAVE_DIR/latest_checkpointed_iteration.txt.

load: builds GPTModel at TP = WORLD from the args of a torch_dist step directory (common.pt or the
common state dist_checkpointing.load_common_state_dict finds), fills it with
dist_checkpointing.load(model.sharded_state_dict(), STEP_DIR) and saves rank 0's logits.

    python megatron_dist_worker.py step STEP_DIR TOKENS.npy OUT_DIR LR PORT

step (one process, TP 1): GPTModel and megatron-core's Adam (get_megatron_optimizer, fp32: its
FP32Optimizer over torch's AdamW) loaded from a torch_dist checkpoint with optimizer state
(dist_checkpointing.load of the model's and the optimizer's sharded state dicts, then
optimizer.load_state_dict); writes the moments it loaded as legacy checkpoints
OUT_DIR/loaded/exp_avg/ and .../exp_avg_sq/ (torch AdamW's state per parameter), takes one step on TOKENS (next-token cross entropy, learning rate LR and weight decay
args.weight_decay x each group's wd_mult, as megatron's scheduler sets them; no clipping) and
writes the gradients as a legacy checkpoint OUT_DIR/grads/ and the state after the step as
OUT_DIR/stepped/.
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_worker import build_model, init, save_logits


def save(legacy_step, save_dir, tokens_file, rank, world):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    name = f"mp_rank_{rank:02d}"
    saved = torch.load(os.path.join(legacy_step, name, "model_optim_rng.pt"), weights_only=False)
    args = saved["args"]
    assert args.tensor_model_parallel_size == world and args.pipeline_model_parallel_size == 1, args
    model = build_model(args, world, 1, 0)
    model.load_state_dict({k: v.float() if isinstance(v, torch.Tensor) else v for k, v in saved["model"].items()},
                          strict=True)
    save_logits([model.eval()], tokens_file, os.path.join(save_dir, "logits.npy"), rank)
    iteration = int(saved["iteration"]) or 1
    step = os.path.join(save_dir, f"iter_{iteration:07d}")
    if rank == 0:
        os.makedirs(step)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": iteration}
    # One writer thread: more spawn writer processes, which outlive the worker holding its output pipes.
    dist_checkpointing.save(state, step, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    if rank == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def load(step, tokens_file, out_file, rank, world, port):
    init(rank, world, port)
    from megatron.core import dist_checkpointing
    common = dist_checkpointing.load_common_state_dict(step)
    args = common["args"]
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = world, 1
    model = build_model(args, world, 1, 0)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, step)
    model.load_state_dict({k: v.float() if isinstance(v, torch.Tensor) else v for k, v in state["model"].items()},
                          strict=True)
    save_logits([model.eval()], tokens_file, out_file, rank)


def on_cpu():
    """megatron-core's optimizers make small tensors on 'cuda' unconditionally: made on the CPU here."""
    def wrap(make):
        def made(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return make(*a, **k)
        return made
    for name in ("tensor", "zeros", "empty", "ones"):
        setattr(torch, name, wrap(getattr(torch, name)))


def save_with_optimizer(save_dir, model, optimizer, args, iteration):
    """SAVE_DIR/iter_{iteration:07d} with the model and optimizer, as Megatron-LM writes them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    step = os.path.join(save_dir, f"iter_{iteration:07d}")
    os.makedirs(step)
    state = {"model": model.sharded_state_dict(), "optimizer": optimizer.sharded_state_dict(model.sharded_state_dict()),
             "args": args, "checkpoint_version": 3.0, "iteration": iteration}
    dist_checkpointing.save(state, step, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def save_legacy(save_dir, tensors, args):
    """{parameter name: tensor} as a legacy (TP 1) checkpoint SAVE_DIR/iter_0000001, which megajax's
    import reads into its own layout."""
    rank = os.path.join(save_dir, "iter_0000001", "mp_rank_00")
    os.makedirs(rank)
    torch.save({"model": {n: t.detach().clone() for n, t in tensors.items()}, "args": args,
                "checkpoint_version": 3.0, "iteration": 1}, os.path.join(rank, "model_optim_rng.pt"))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")


def step(step_dir, tokens_file, out_dir, lr, port=None):
    if port is not None:
        init(0, 1, port)
    on_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    common = dist_checkpointing.load_common_state_dict(step_dir)
    args, iteration = common["args"], int(common["iteration"])
    model = build_model(args, 1, 1, 0)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, bf16=False, fp16=False, clip_grad=0.0), [ddp])
    state = dist_checkpointing.load({"model": model.sharded_state_dict(), "optimizer": optimizer.sharded_state_dict(
        model.sharded_state_dict(), is_loading=True)}, step_dir)
    model.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    inner = optimizer.chained_optimizers[0].optimizer  # torch's AdamW
    for what in ("exp_avg", "exp_avg_sq"):  # what it loaded, as legacy checkpoints
        save_legacy(os.path.join(out_dir, "loaded", what), {n: inner.state[p][what] for n, p in model.named_parameters()},
                    args)
    for group in optimizer.param_groups:  # OptimizerParamScheduler's part
        group["lr"], group["weight_decay"] = lr, args.weight_decay * group["wd_mult"]
    tokens = torch.from_numpy(np.load(tokens_file)).long()
    b, l = tokens.shape
    positions = torch.arange(l)[None].expand(b, l)
    mask = torch.triu(torch.ones(l, l, dtype=torch.bool), 1)[None, None]
    optimizer.zero_grad()
    ddp.zero_grad_buffer()
    logits = ddp(tokens, positions, mask)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    ddp.finish_grad_sync()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    ok, _, _ = optimizer.step()
    assert ok
    save_legacy(os.path.join(out_dir, "grads"), grads, args)
    save_with_optimizer(os.path.join(out_dir, "stepped"), model, optimizer, args, iteration + 1)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "save":
        toks, rank, world, port, *pairs = rest
        then = pairs[pairs.index("--step") + 1:] if "--step" in pairs else None
        pairs = pairs[:pairs.index("--step")] if then else pairs
        init(int(rank), int(world), int(port))
        for legacy, out in zip(pairs[::2], pairs[1::2]):
            if int(rank) == 0:
                os.makedirs(out)
            dist.barrier()
            save(legacy, out, toks, int(rank), int(world))
        if then:  # in the same process (one megatron-core start-up for all)
            step(then[0], toks, then[1], float(then[2]))
    elif mode == "step":
        directory, toks, out, lr, port = rest
        step(directory, toks, out, float(lr), int(port))
    else:
        step, toks, out, rank, world, port = rest
        load(step, toks, out, int(rank), int(world), int(port))
    import multiprocessing
    for child in multiprocessing.active_children():  # dist_checkpointing's writer process, else orphaned
        child.terminate()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
