"""Checkpoints do not know the pipeline layout: the train state keeps its stacks in the layout's stage
form between steps, a checkpoint holds them in model order, so a state saved under one layout resumes
bitwise under another (even split, uneven, no pipeline); a legacy Megatron export at an uneven layout
puts each layer in the rank file megatron-core's own layout parser names; a wrong layout is one
clear error, nothing written."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from megajax.checkpoint.manager import CheckpointSource
from megajax.plan import make_plan
from megajax.train.loop import train
from megajax.train.setup import build_setup, initial_state
from test_bad_input import ROOT, megajax, paragraph

MODEL = ["model.num_layers=8", "train.micro_batch=2", "mesh.data=1", "checkpoint.every=1"]
UNEVEN = ["mesh.pipeline=2", "parallel.first_pipeline_stage_layers=3"]


@pytest.fixture(scope="module")
def uneven_run(tmp_path_factory):
    """One step of an 8-layer Llama at pipeline 2, 3 + 5 layers, checkpointed (2 devices): (its overrides,
    its run directory)."""
    from conftest import SMALL
    from megajax.config import load_config
    run_dir = tmp_path_factory.mktemp("uneven") / "run"
    overrides = SMALL + MODEL + UNEVEN + ["train.steps=1", f"train.run_dir={run_dir}"]
    train(load_config(overrides=overrides), devices=jax.devices()[:2])
    return overrides, run_dir


def _resumed(base, *overrides):
    """The state a run of `base` changed by `overrides` resumes from base's run directory (2 devices), in
    the checkpoints' form (numpy), and its parameters for generation."""
    from megajax.config import load_config
    changed = load_config(overrides=[*base, *overrides])
    setup = build_setup(make_plan(changed, 2), jax.devices()[:2])
    state, _, origin, step = initial_state(setup)
    assert step == 1, origin
    assert (setup.staging is not None) == (changed.mesh.pipeline > 1)
    logical = setup.checkpoint_form(state)
    return jax.tree.map(np.asarray, (logical.params, logical.opt_state)), setup.model_params(state)


def test_a_checkpoint_resumes_bitwise_under_another_layout(uneven_run):
    base, run_dir = uneven_run
    saved = CheckpointSource(Path(run_dir) / "checkpoints" / "1")
    states = {}
    for name, overrides in {"uneven": [], "even": ["parallel.first_pipeline_stage_layers=null"],
                            "last 3": ["parallel.first_pipeline_stage_layers=null",
                                       "parallel.last_pipeline_stage_layers=3"],
                            "no pipeline": ["parallel.first_pipeline_stage_layers=null", "mesh.pipeline=1",
                                            "mesh.data=2"]}.items():
        states[name], params = _resumed(base, *overrides)
        flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
        for path, x in flat.items():  # the parameters in model order, as the checkpoint holds them
            key = "/".join(str(getattr(p, "key", p)) for p in path)
            np.testing.assert_array_equal(np.asarray(x), saved.get(key), err_msg=f"{name}: {key}")
    first = jax.tree.leaves(states.pop("uneven"))
    for name, state in states.items():
        for a, b in zip(first, jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_megatron_legacy_export_at_an_uneven_layout_follows_megatron_core(uneven_run, tmp_path):
    """Each rank file holds the layers megatron-core's PipelineParallelLayerLayout gives its rank, the
    args name the layout, and the import reads the model back."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megajax.checkpoint.megatron import export_megatron, import_megatron
    from megajax.checkpoint.torch_pickle import load
    _, run_dir = uneven_run
    source = CheckpointSource(Path(run_dir) / "checkpoints" / "1")
    layout = "Ettt|tttttL"
    out = export_megatron(source, tmp_path / "mcore", pipeline_parallel=2, dtype="fp32", pipeline_layout=layout)
    theirs = PipelineParallelLayerLayout(layout, 2)
    q = source.get("layers/attn/q/kernel")  # [layers, D, H, hd]
    for s in range(2):
        sd = load(out / "release" / f"mp_rank_00_{s:03d}" / "model_optim_rng.pt")
        args = sd["args"]
        layers = sorted({int(k.split(".")[2]) for k in sd["model"] if k.startswith("decoder.layers.")})
        assert len(layers) == theirs.get_num_layers_to_build(pp_rank=s)
        offset = theirs.get_layer_offset(pp_rank=s)
        for k in layers:  # the layer's query weights: megajax's layer offset + k, as Megatron numbers them
            qkv = sd["model"][f"decoder.layers.{k}.self_attention.linear_qkv.weight"].float().numpy()
            heads, hd = q.shape[2], q.shape[3]
            kv = (qkv.shape[0] // hd - heads) // 2
            first_q = qkv.reshape(kv, -1, hd, q.shape[1])[0, 0]  # group 0's first query head [hd, D]
            np.testing.assert_allclose(first_q, q[offset + k][:, 0, :].T, rtol=1e-6)
        assert args.pipeline_model_parallel_layout == layout
    overrides, params = import_megatron(out)
    np.testing.assert_allclose(params["layers"]["attn"]["q"]["kernel"], q, rtol=1e-6)


def test_a_wrong_export_layout_is_one_error_nothing_written(uneven_run, tmp_path):
    _, run_dir = uneven_run
    p = megajax("export", "--format", "megatron", "--ckpt-format", "torch", "--checkpoint", str(run_dir),
                "--output", str(tmp_path / "out"), "--pipeline-parallel", "2", "--pipeline-layout", "Ett|tttttL")
    paragraph(p, "export", "--pipeline-layout = 'Ett|tttttL'", "counts 7 decoder layers (t) but the model has 8")
    assert not (tmp_path / "out").exists()


BAD_LAYOUTS = [
    (["parallel.pipeline_layout=Ettt|tttL"], ["parallel.pipeline_layout = 'Ettt|tttL'", "counts 6 decoder layers",
                                               "the model has 8"]),
    (["parallel.pipeline_layout=Ett(t|ttttt)*L"], ["'(', ')', '*' are not part of Megatron's layout syntax"]),
    (["parallel.pipeline_layout=Etttt|ttt|tL"], ["names 3 chunks but this run has mesh.pipeline=2"]),
    (["parallel.first_pipeline_stage_layers=3", "parallel.account_for_loss_in_pipeline_split=true"],
     ["do not go together"]),
    (["mesh.pipeline=1", "parallel.first_pipeline_stage_layers=3"], ["needs pipeline parallelism"]),
    (["parallel.first_pipeline_stage_layers=9"], ["-1 layers are left for 1 middle stages"]),
]


@pytest.mark.parametrize("overrides, words", BAD_LAYOUTS)
def test_a_layout_the_run_cannot_take_is_one_error_naming_it(small_config, overrides, words):
    from megajax.errors import UserError
    with pytest.raises(UserError) as e:
        make_plan(small_config("model.num_layers=8", "mesh.pipeline=2", "train.micro_batch=1", *overrides), 2)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_megajax_train_with_a_wrong_layout_is_one_paragraph_nothing_written(tmp_path):
    import os
    import subprocess
    import sys
    from conftest import xla_flags
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags(None))  # mesh.cpu_devices gives the devices
    overrides, words = BAD_LAYOUTS[0]
    p = subprocess.run([sys.executable, "-m", "megajax.cli", "train", "--config", "model/tiny", "model.num_layers=8",
                        "mesh.pipeline=2", "mesh.cpu_devices=2", "train.micro_batch=1", f"train.run_dir={run_dir}",
                        *overrides], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    paragraph(p, "train", *words)
    assert not run_dir.exists()
