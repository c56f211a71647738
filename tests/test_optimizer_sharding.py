"""The distributed optimizer (ZeRO-1) and FSDP at data-parallel sizes that do not divide the model's
dims: the stored state padded (megajax/mesh.py PADDED_AXES), the step equal to one device, and
checkpoints that crop or pad onto any other split (megajax/checkpoint/manager.py LOGICAL_SHAPES).

The small model's hidden size is 64: 3, 6 and 12 do not divide it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import SMALL, xla_flags
from layout_parity import PARITY, assert_same_run, run
from megajax.inference.text import training_sample
from megajax.checkpoint.manager import LOGICAL_SHAPES, CheckpointSource, find_step_dir, read_meta
from megajax.cli import main
from megajax.plan import make_plan
from megajax.train.loop import train
from megajax.train.setup import build_setup

ROOT = Path(__file__).resolve().parent.parent
BATCH = ["train.global_batch=12"]  # divides over data-parallel sizes 1, 2, 3, 4, 6 and 12
ZERO1 = "parallel.distributed_optimizer=true"

# name: (devices, layout, the reference's microbatch (None: the whole batch))
LAYOUTS = {
    "data3_tensor2_zero1": (6, ["mesh.data=3", "mesh.tensor=2", ZERO1], None),
    "fsdp3_tensor2": (6, ["mesh.data=1", "mesh.fsdp=3", "mesh.tensor=2"], None),
    "data6_zero1": (6, ["mesh.data=6", ZERO1], None),
    # several microbatches: the per-shard gradients, reduce-scattered once onto the padded shards
    "data2_fsdp3_zero1_accumulating": (6, ["mesh.data=2", "mesh.fsdp=3", ZERO1, "train.micro_batch=1"], 6),
    "pipeline2_data3_zero1": (6, ["mesh.pipeline=2", "mesh.data=3", ZERO1, "train.micro_batch=2"], 6),
}


def _reference(small_config, micro: int | None, steps: int = 4):
    extra = [] if micro is None else [f"train.micro_batch={micro}"]
    return run(small_config, "mesh.data=1", *BATCH, *extra, devices=jax.devices()[:1], steps=steps)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uneven_data_parallel_sizes_match_one_device(small_config, name):
    devices, layout, micro = LAYOUTS[name]
    setup = build_setup(make_plan(small_config(*layout, *BATCH), devices), jax.devices()[:devices])
    assert setup.padded()  # the case under test: some dim is stored padded
    q = setup.target().opt_state[0].mu["layers"]["attn"]["q"]["kernel"]  # [layers, embed, heads, head_dim]
    assert q.shape[1] == 66 and setup.logical_target().opt_state[0].mu["layers"]["attn"]["q"]["kernel"].shape[1] == 64
    got = run(small_config, *layout, *BATCH, devices=jax.devices()[:devices])  # parameters after step 1 cropped
    assert_same_run(got, _reference(small_config, micro))


def test_data_parallel_12_matches_one_device(small_config, tmp_path):
    """12 simulated devices (a `megajax train` of its own): data 12 with the distributed optimizer."""
    run_dir = tmp_path / "dp12"
    args = [*SMALL, *PARITY, *BATCH, "train.steps=4", "mesh.data=12", ZERO1, f"train.run_dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags(12))
    p = subprocess.run([sys.executable, "-m", "megajax.cli", "train", *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    ref = _reference(small_config, None)
    np.testing.assert_allclose([r["loss"] for r in records], ref.losses, rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in records], ref.grad_norms, rtol=1e-5)
    assert LOGICAL_SHAPES in read_meta(find_step_dir(run_dir))


def test_padded_checkpoints_resume_export_and_generate_on_other_meshes(small_config, tmp_path):
    """fsdp 3 (stored padded) -> data 4 x tensor 2 with the distributed optimizer (unpadded, as every
    checkpoint before padding was) -> data 6 with it (padded again): the same losses as one run on one
    device; the checkpoint's readers see the logical shapes and its padding is zeros."""
    fixed = [*PARITY, *BATCH, "optim.decay_steps=4"]
    full = train(small_config(*fixed, "mesh.data=1", f"train.run_dir={tmp_path / 'full'}", steps=4),
                 devices=jax.devices()[:1])
    run_dir = f"train.run_dir={tmp_path / 'run'}"
    first = train(small_config(*fixed, run_dir, "mesh.data=1", "mesh.fsdp=3", "mesh.tensor=2",
                               "train.sample_tokens=4", steps=2), devices=jax.devices()[:6], on_end=[training_sample])
    assert first.sample  # the end-of-training sample read the padded parameters (Setup.model_params)
    step2 = find_step_dir(tmp_path / "run")
    record = read_meta(step2)[LOGICAL_SHAPES]
    name = "params.layers.mlp.up.kernel"  # [layers, embed, mlp]: embed over fsdp 3
    assert record[name] == [2, 64, 128]
    source = CheckpointSource(step2)
    assert source.shape("layers/mlp/up/kernel") == (2, 64, 128)
    assert source.get("layers/mlp/up/kernel").shape == (2, 64, 128)
    stored = CheckpointSource(step2, prefix="params.layers.mlp.up.")._store(name)
    padding = np.asarray(stored[:, 64:].read().result())
    assert padding.shape == (2, 2, 128) and not padding.any()
    # An export reads the logical tensors (the first layer's up projection: rows of gate_up or up_proj).
    assert main(["export", "--format", "hf", "--checkpoint", str(step2), "--output", str(tmp_path / "hf")]) == 0
    from safetensors.numpy import load_file
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    up = exported["model.layers.0.mlp.up_proj.weight"]  # in the export's dtype
    np.testing.assert_array_equal(up, source.get("layers/mlp/up/kernel")[0].T.astype(up.dtype))

    second = train(small_config(*fixed, run_dir, "mesh.data=4", "mesh.tensor=2", ZERO1, steps=3))
    assert LOGICAL_SHAPES not in read_meta(find_step_dir(tmp_path / "run"))
    third = train(small_config(*fixed, run_dir, "mesh.data=6", ZERO1, steps=4), devices=jax.devices()[:6])
    np.testing.assert_allclose(first.losses + second.losses + third.losses, full.losses, rtol=1e-5)
