"""Megatron-Core torch_dist checkpoints, written by megatron-core's own dist_checkpointing.save, read by
megajax: exact parameters, and one command to a Hugging Face export whose transformers logits equal
megatron-core's."""

import contextlib
import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from random_model import VOCAB, random_model  # noqa: E402
from megajax.checkpoint.common import model_overrides  # noqa: E402
from megajax.checkpoint.megatron import export_megatron, import_megatron  # noqa: E402
from megajax.checkpoint.source import DictSource, flatten  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.errors import CheckpointError  # noqa: E402

WORKER = str(Path(__file__).with_name("megatron_dist_worker.py"))
MOE = ("model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "model.ffn_hidden_size=32")
CASES = {"dense": (), "moe": MOE}  # llama (GQA, SwiGLU, RMSNorm, RoPE, untied); + SequentialMLP experts [L, E, ...]
SEQ = 16
ADAM_STEP = 5  # the update count of the Adam state exported with --with-optimizer
LR = 1e-3  # megatron-core's step from it


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_core_runs(trained, tmp_path_factory):
    """(root, {case: (cfg, params, save dir, tokens)}): one megatron-core process (megatron_dist_worker.py
    save) for all: each random model written as a legacy checkpoint, loaded into megatron-core's GPTModel
    and saved by its dist_checkpointing; and its Adam step from `trained` exported with --with-optimizer
    (fp32, megatron-core 0.16's form; step: loaded/, grads/, stepped/ under root/step)."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("torch_dist")
    toks = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ)).astype(np.int64)
    np.save(root / "tokens.npy", toks)
    pairs, out = [], {}
    for case, overrides in CASES.items():
        cfg, _, params = random_model("llama", *overrides)
        export_megatron(DictSource(params, cfg.model), root / f"{case}-legacy", dtype="fp32", iteration=7)
        pairs += [str(root / f"{case}-legacy" / "iter_0000007"), str(root / case)]
        out[case] = (cfg, params, root / case, toks)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main(["export", "--format", "megatron", "--checkpoint", str(trained[3]), "--output",
                     str(root / "adam"), "--dtype", "fp32", "--with-optimizer", "--megatron-version", "0.16"]) == 0
    assert f"common state in common.pt; with the optimizer state (Adam moments, step {ADAM_STEP})" in said.getvalue()
    step = ["--step", str(root / "adam" / f"iter_{ADAM_STEP:07d}"), str(root / "step"), str(LR)]
    with open(root / "worker.log", "w") as log:  # a file, not a pipe: no wait on what the worker spawned
        proc = subprocess.run([sys.executable, WORKER, "save", str(root / "tokens.npy"), "0", "1",
                               str(free_port()), *pairs, *step], env=dict(os.environ, OMP_NUM_THREADS="1"),
                              stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, (root / "worker.log").read_text()[-3000:]
    return root, out


@pytest.fixture(scope="module")
def saved(megatron_core_runs):
    """{case: (cfg, params, save dir, tokens, megatron-core's logits)} (megatron_core_runs)."""
    return {case: (*v, np.load(v[2] / "logits.npy")) for case, v in megatron_core_runs[1].items()}


def assert_same_params(got, want):
    got, want = dict(flatten(got)), dict(flatten(want))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("case", CASES)
def test_megatron_core_torch_dist_imports_exactly(saved, case):
    cfg, params, save, _, _ = saved[case]
    step = save / "iter_0000007"
    assert {p.name for p in step.iterdir()} >= {".metadata", "common.pt", "metadata.json", "__0_0.distcp"}
    for where in (save, step):  # the save directory (its tracker) or the iteration's directory
        overrides, got = import_megatron(where)
        assert overrides == model_overrides(cfg.model)
        assert_same_params(got, params)


@pytest.mark.parametrize("case", CASES)
def test_torch_dist_to_hugging_face_in_one_command(saved, case, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, _, save, toks, theirs = saved[case]
    assert main(["export", "--format", "hf", "--checkpoint", str(save), "--output", str(tmp_path / "hf"),
                 "--tokenizer", "byte", "--dtype", "fp32"]) == 0
    assert str(save) in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == ("MixtralForCausalLM" if case == "moe" else "LlamaForCausalLM")
    with torch.no_grad():
        logits = model(torch.from_numpy(toks)).logits.numpy()
    np.testing.assert_allclose(logits, theirs[..., :VOCAB], atol=1e-4, rtol=1e-4)


def to_common_state_form(step: Path, out: Path) -> Path:
    """A copy of `step` in megatron-core 0.19's form: no common.pt, the common state a bytes entry
    `common_state/shard_0_1` of the shards (torch.save of [state], as its ShardedObject is written)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    shutil.copytree(step, out)
    common = torch.load(out / "common.pt", weights_only=False)
    (out / "common.pt").unlink()
    buffer = io.BytesIO()
    torch.save([common], buffer)
    (out / "__0_9.distcp").write_bytes(buffer.getvalue())
    md = pickle.loads((out / ".metadata").read_bytes())
    key = "common_state/shard_0_1"
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__0_9.distcp", 0, len(buffer.getvalue()))
    (out / ".metadata").write_bytes(pickle.dumps(md))
    (out / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    return out


def test_common_state_form_of_megatron_core_0_19(saved, tmp_path):
    cfg, params, save, _, _ = saved["moe"]
    step = to_common_state_form(save / "iter_0000007", tmp_path / "iter_0000007")
    overrides, got = import_megatron(step)
    assert overrides == model_overrides(cfg.model)
    assert_same_params(got, params)


def test_bad_torch_dist_inputs_name_the_file(saved, tmp_path, capsys):
    import torch
    save = saved["dense"][2]

    def copy(name):
        shutil.copytree(save, tmp_path / name)
        return tmp_path / name

    d = copy("no-tracker")
    (d / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(CheckpointError, match=r"no-tracker'.*no latest_checkpointed_iteration.txt"):
        import_megatron(d)
    d = copy("wrong-tracker")
    (d / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration.txt' names iter_0000009.*does not"):
        import_megatron(d)

    d = copy("missing-shard")
    (d / "iter_0000007" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"shard file '.*missing-shard/iter_0000007/__0_0.distcp' is missing"):
        import_megatron(d)
    assert main(["import", "--format", "megatron", "--input", str(d), "--output", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert "__0_0.distcp' is missing" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1

    d = copy("truncated-shard")
    shard = d / "iter_0000007" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"shard file '.*truncated-shard/iter_0000007/__0_0.distcp' is "
                                              r"truncated"):
        import_megatron(d)

    d = copy("rotary-interleaved")
    common = torch.load(d / "iter_0000007" / "common.pt", weights_only=False)
    common["args"].rotary_interleaved = True
    torch.save(common, d / "iter_0000007" / "common.pt")
    with pytest.raises(CheckpointError, match=r"rotary-interleaved/iter_0000007/common.pt'.*rotary_interleaved=True cannot be "
                                              r"represented"):
        import_megatron(d)

    d = copy("foreign-pickle")
    (d / "iter_0000007" / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(CheckpointError, match=r"foreign-pickle/iter_0000007/.metadata' holds a Python object "
                                              r"outside .*posix.system"):
        import_megatron(d)


def test_checkpoint_load_takes_a_torch_dist_checkpoint(saved, tmp_path, capsys):
    """checkpoint.load=SAVE_DIR of megatron-core's torch_dist save (or of a legacy checkpoint): the model
    from its args, its parameters, and the first step's loss that of the same checkpoint imported with
    `megajax import` first."""
    from conftest import SMALL
    from megajax.checkpoint.stored_model import train_config
    from megajax.train.loop import train
    cfg, _, save, _, _ = saved["dense"]
    assert main(["import", "--format", "megatron", "--input", str(save), "--output", str(tmp_path / "mj")]) == 0
    capsys.readouterr()
    run = [o for o in SMALL if not o.startswith("model.")] + ["train.steps=1", "data.tokenizer=byte"]
    direct = train_config(overrides=run + [f"checkpoint.load={save}", f"train.run_dir={tmp_path / 'a'}"])
    imported = train_config(overrides=run + [f"checkpoint.load={tmp_path / 'mj'}", f"train.run_dir={tmp_path / 'b'}"])
    assert model_overrides(direct.model) == model_overrides(imported.model) == model_overrides(cfg.model)
    import jax
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup, initial_state
    state, consumed, origin, _ = initial_state(build_setup(make_plan(direct, len(jax.devices()))))
    assert origin == f"parameters from the Megatron checkpoint {save}, optimizer state fresh" and consumed == 0
    assert_same_params(jax.tree.map(np.asarray, state.params), saved["dense"][1])  # its weights, not an init
    legacy = save.parent / "dense-legacy"  # the legacy checkpoint megatron-core loaded before saving torch_dist
    state, _, origin, _ = initial_state(build_setup(make_plan(
        train_config(overrides=run + [f"checkpoint.load={legacy}", f"train.run_dir={tmp_path / 'c'}"]),
        len(jax.devices()))))
    assert origin.startswith(f"parameters from the Megatron checkpoint {legacy}")
    with pytest.raises(CheckpointError, match=r"checkpoint.step=3: .* is a Megatron checkpoint"):
        initial_state(build_setup(make_plan(train_config(overrides=run + [
            f"checkpoint.load={legacy}", "checkpoint.step=3", f"train.run_dir={tmp_path / 'd'}"]), 1)))
    assert_same_params(jax.tree.map(np.asarray, state.params), saved["dense"][1])
    first = train(direct)
    assert f"parameters from the Megatron checkpoint {save}" in capsys.readouterr().out
    second = train(imported)
    assert np.isfinite(first.losses[0]) and first.losses[0] > 4.0  # a random model, not a trivial loss
    assert first.losses[0] == second.losses[0]

    with pytest.raises(CheckpointError, match=r"model.hidden_size=128 but the checkpoint has model.hidden_size=64"):
        train_config(overrides=run + [f"checkpoint.load={save}", "model.hidden_size=128"])


def megatron_core_logits(step: Path, tokens: Path, world: int, out: Path) -> np.ndarray:
    """Rank 0's logits of megatron-core's GPTModel at TP = world, filled by its dist_checkpointing.load
    from the torch_dist step directory `step` (world gloo processes)."""
    port = str(free_port())
    with open(out.with_suffix(".log"), "w") as log:
        procs = [subprocess.Popen([sys.executable, WORKER, "load", str(step), str(tokens), str(out), str(rank),
                                   str(world), port], env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log,
                                  stderr=subprocess.STDOUT) for rank in range(world)]
        codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * world, out.with_suffix(".log").read_text()[-3000:]
    return np.load(out)


@pytest.mark.parametrize("case,tp", [("dense", 1), ("moe", 2)])
def test_torch_dist_export_loads_in_megatron_core(saved, case, tp, tmp_path, capsys):
    """megajax export --format megatron (torch_dist, the default) of a model; megatron-core's own
    dist_checkpointing.load fills a GPTModel built from the written args at TP 1 and, resharding the
    global tensors, at TP 2: its logits equal megatron-core's from the model the export came from, and
    megajax's."""
    _, _, save, toks, theirs = saved[case]
    out = tmp_path / "mcore"
    assert main(["export", "--format", "megatron", "--checkpoint", str(save), "--output", str(out),
                 "--tokenizer", "byte", "--dtype", "fp32", "--megatron-version", "0.16"]) == 0
    assert "torch_dist for megatron-core 0.16: common state in common.pt" in capsys.readouterr().out
    step = out / "release"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert {p.name for p in step.iterdir()} == {".metadata", "__0_0.distcp", "common.pt", "metadata.json"}
    assert json.loads((step / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}
    np.save(tmp_path / "tokens.npy", toks)
    logits = megatron_core_logits(step, tmp_path / "tokens.npy", tp, tmp_path / "logits.npy")
    np.testing.assert_allclose(logits, theirs, atol=1e-4, rtol=1e-4)
    from megajax.train.state import build_model_spec
    cfg, params = saved[case][:2]
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    ours = np.asarray(spec.apply(params, toks))
    np.testing.assert_allclose(logits[..., :VOCAB], ours[..., :VOCAB], atol=1e-4, rtol=1e-4)  # megajax's own


@pytest.mark.parametrize("version", ["0.16", "0.19"])
def test_torch_dist_export_round_trips_exactly(saved, version, tmp_path):
    """megajax -> torch_dist (either common-state form) -> megajax: the same parameters, bit for bit, and
    the tensors under the names and global shapes megatron-core's own save gave them."""
    from megajax.checkpoint.megatron import export_torch_dist
    from megajax.checkpoint.torch_dist import DistCheckpoint
    for case in CASES:
        cfg, params, save, _, _ = saved[case]
        out = export_torch_dist(DictSource(params, cfg.model), tmp_path / case, dtype="fp32", iteration=3,
                                megatron_version=version)
        step = out / "iter_0000003"
        assert (step / "common.pt").is_file() == (version == "0.16")
        overrides, got = import_megatron(out)
        assert overrides == model_overrides(cfg.model)
        assert_same_params(got, params)
        ours, theirs = DistCheckpoint(step), DistCheckpoint(save / "iter_0000007")
        assert {k: ours.shape(k) for k in ours.keys()} == {k: theirs.shape(k) for k in theirs.keys()}
        assert set(ours.byte_keys()) == set(theirs.byte_keys()) | (
            {"common_state/shard_0_1"} if version == "0.19" else set())


def test_torch_dist_export_of_layers_that_differ_is_megatron_cores_layout(tmp_path):
    """MoE layers 0 and 2, dense layers 1 and 3 (moe_layer_freq 2), a shared expert and q/k norms: the
    torch_dist export keeps each layer under its own keys, with the keys, global shapes and objects of
    megatron-core's own dist_checkpointing.save of the same model; both import bit for bit."""
    pytest.importorskip("megatron.core")
    from megajax.checkpoint.megatron import export_torch_dist
    from megajax.checkpoint.torch_dist import DistCheckpoint
    cfg, _, params = random_model("llama", "model.num_layers=4", *MOE[:3], "model.ffn_hidden_size=96",
                                  "model.moe_layer_freq=2", "model.moe_shared_expert_ffn_size=48",
                                  "model.qk_norm=true", "model.head_dim=16")
    legacy = export_megatron(DictSource(params, cfg.model), tmp_path / "legacy", dtype="fp32", iteration=1)
    ours = export_torch_dist(DictSource(params, cfg.model), tmp_path / "dist", dtype="fp32", iteration=1,
                             megatron_version="0.16")
    np.save(tmp_path / "tokens.npy", np.random.default_rng(1).integers(0, VOCAB, (2, SEQ)))
    with open(tmp_path / "worker.log", "w") as log:
        proc = subprocess.run([sys.executable, WORKER, "save", str(tmp_path / "tokens.npy"), "0", "1",
                               str(free_port()), str(legacy / "iter_0000001"), str(tmp_path / "theirs")],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT,
                              timeout=300)
    assert proc.returncode == 0, (tmp_path / "worker.log").read_text()[-3000:]
    mine, theirs = DistCheckpoint(ours / "iter_0000001"), DistCheckpoint(tmp_path / "theirs" / "iter_0000001")
    assert {k: mine.shape(k) for k in mine.keys()} == {k: theirs.shape(k) for k in theirs.keys()}
    assert set(mine.byte_keys()) == set(theirs.byte_keys())
    assert "decoder.layers.1.mlp.linear_fc1.weight" in set(mine.keys())  # per layer: no stacked layer dim
    for path in (ours, tmp_path / "theirs"):
        overrides, back = import_megatron(path, trust=True)
        assert overrides == model_overrides(cfg.model)
        assert_same_params(back, params)


def test_torch_dist_round_trips_qk_layernorm_and_pre_softmax_routing(tmp_path):
    """A Qwen3-MoE-style model (q/k norms, pre-softmax routing; every layer MoE: torch_dist export takes
    uniform layers) through torch_dist: megatron-core's dist_checkpointing.load fills a GPTModel built with
    qk_layernorm at TP 2 that computes megajax's logits; back in megajax, the same parameters bit for bit."""
    from megajax.checkpoint.megatron import export_torch_dist
    from megajax.checkpoint.torch_dist import DistCheckpoint
    cfg, _, params = random_model("llama", "model.qk_norm=true", "model.head_dim=16", "model.num_experts=4",
                                  "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                                  "model.moe_router_pre_softmax=true")
    out = export_torch_dist(DictSource(params, cfg.model), tmp_path / "qwen3", dtype="fp32", iteration=3,
                            megatron_version="0.16")
    overrides, got = import_megatron(out)
    assert overrides == model_overrides(cfg.model) and overrides["qk_norm"] and overrides["moe_router_pre_softmax"]
    assert_same_params(got, params)
    saved = DistCheckpoint(out / "iter_0000003")
    assert {k: saved.shape(k) for k in saved.keys() if "layernorm" in k and "self_attention" in k} == {
        "decoder.layers.self_attention.q_layernorm.weight": (2, 16),
        "decoder.layers.self_attention.k_layernorm.weight": (2, 16)}
    toks = np.random.default_rng(1).integers(0, VOCAB, (2, 16)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", toks)
    logits = megatron_core_logits(out / "iter_0000003", tmp_path / "tokens.npy", 2, tmp_path / "logits.npy")
    from megajax.train.state import build_model_spec
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    np.testing.assert_allclose(logits[..., :VOCAB], np.asarray(spec.apply(params, toks))[..., :VOCAB],
                               atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cfg, params, (mu, nu), save dir): a megajax checkpoint of step ADAM_STEP holding the dense model's
    parameters and an Adam state as training leaves it (optax adamw's, moments drawn at random, both
    counts ADAM_STEP), saved as the train state's `params` and `opt_state` are."""
    import jax
    from megajax.checkpoint.manager import Checkpointer
    from megajax.train.optimizer import make_optimizer
    cfg, _, params = random_model("llama", *CASES["dense"])
    rng = np.random.default_rng(2)
    mu = jax.tree.map(lambda x: rng.normal(0, 1e-2, x.shape).astype(np.float32), params)
    # |mu| <= sqrt(nu), as Adam's moments are: updates of about lr, not lr / sqrt(a tiny nu)
    nu = jax.tree.map(lambda m: (m.astype(np.float64) ** 2 * rng.uniform(1, 4, m.shape) + 1e-8).astype(np.float32),
                      mu)
    for moments in (mu, nu):  # the vocabulary padding gets no gradient
        moments["embed"]["embedding"][VOCAB:] = 0
        moments["output"][:, VOCAB:] = 0
    opt = make_optimizer(cfg.optim, cfg.train.steps).init(params)
    count = np.int32(ADAM_STEP)
    opt = (opt[0]._replace(count=count, mu=mu, nu=nu), opt[1], opt[2]._replace(count=count))
    run = tmp_path_factory.mktemp("adam")
    ckpt = Checkpointer(run / "checkpoints", keep=1, async_save=False)
    state = jax.tree.map(jax.numpy.asarray, {"step": count, "params": params, "opt_state": opt})
    ckpt.save(ADAM_STEP, state, {"step": ADAM_STEP, "consumed_samples": 40, "config": cfg.to_dict()}, wait=True)
    ckpt.close()
    return cfg, params, (mu, nu), run


@pytest.fixture(scope="module")
def continued(megatron_core_runs):
    """(the --with-optimizer export, the directory of megatron-core's step from it)."""
    root = megatron_core_runs[0]
    return root / "adam", root / "step"


def test_export_with_optimizer_round_trips_and_megatron_core_continues(trained, saved, continued, tmp_path):
    """megajax export --with-optimizer: megatron-core 0.16.1's get_megatron_optimizer (FP32Optimizer over
    torch's AdamW) loads the Adam moments bit for bit, and its next step equals optax's from the same
    state and gradients (the step count carried over: bias correction); megajax reads its moments and
    step back, and megajax -> torch_dist -> megajax is exact in both common-state forms."""
    import jax
    import optax
    from megajax.checkpoint.megatron import export_torch_dist, import_megatron_adam
    from megajax.checkpoint.megatron_optimizer import checkpoint_adam
    from megajax.checkpoint.manager import CheckpointSource, find_step_dir, read_meta
    from megajax.checkpoint.torch_dist import DistCheckpoint
    from megajax.config import OptimConfig
    from megajax.train.optimizer import make_optimizer
    cfg, params, (mu, nu), run = trained
    out, worker = continued
    step = out / f"iter_{ADAM_STEP:07d}"
    assert json.loads((step / "metadata.json").read_text())["common_backend"] == "torch"
    ours, theirs = DistCheckpoint(step), DistCheckpoint(saved["dense"][2] / "iter_0000007")
    model_keys = {k: theirs.shape(k) for k in theirs.keys()}
    assert {k: ours.shape(k) for k in ours.keys()} == {**model_keys, **{
        f"optimizer.state.{s}.{k}": v for k, v in model_keys.items() for s in ("exp_avg", "exp_avg_sq")}}
    got = import_megatron_adam(out)
    assert got["count"] == ADAM_STEP and got["params"] is None
    assert_same_params(got["mu"], mu)
    assert_same_params(got["nu"], nu)
    step_dir = find_step_dir(run)
    # megatron-core 0.19's form (the common state inside the shards), bf16 weights: fp32 main parameters too
    back = import_megatron_adam(export_torch_dist(
        CheckpointSource(step_dir), tmp_path / "0.19", dtype="bf16", iteration=ADAM_STEP, megatron_version="0.19",
        adam=checkpoint_adam(step_dir, read_meta(step_dir))))
    assert back["count"] == ADAM_STEP
    assert "optimizer.state.fp32_param.output_layer.weight" in DistCheckpoint(tmp_path / "0.19" / step.name).keys()
    for name, want in (("mu", mu), ("nu", nu), ("params", params)):
        assert_same_params(back[name], want)

    for what, want in (("exp_avg", mu), ("exp_avg_sq", nu)):  # what megatron-core's optimizer holds
        assert_same_params(import_megatron(worker / "loaded" / what)[1], want)
    grads = import_megatron(worker / "grads")[1]
    theirs_params = import_megatron(worker / "stepped")[1]
    theirs_adam = import_megatron_adam(worker / "stepped")
    o = cfg.optim
    tx = make_optimizer(OptimConfig(lr=LR, min_lr=LR, warmup_steps=0, decay_style="constant",
                                    weight_decay=o.weight_decay, beta1=o.beta1, beta2=o.beta2, eps=o.eps), 100)
    state = tx.init(params)
    state = (state[0]._replace(count=np.int32(ADAM_STEP), mu=mu, nu=nu), state[1],
             state[2]._replace(count=np.int32(ADAM_STEP)))
    updates, state = tx.update(grads, state, params)
    ours_params = optax.apply_updates(params, updates)
    assert theirs_adam["count"] == ADAM_STEP + 1 == int(state[0].count)
    for name, a, b in (("params", theirs_params, ours_params), ("mu", theirs_adam["mu"], state[0].mu),
                       ("nu", theirs_adam["nu"], state[0].nu)):
        a, b = dict(flatten(a)), dict(flatten(jax.tree.map(np.asarray, b)))
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7 if name != "nu" else 1e-10,
                                       err_msg=f"{name} {k}")
    assert not np.array_equal(dict(flatten(theirs_params))["output"], dict(flatten(params))["output"])


def test_checkpoint_load_restores_megatron_optimizer_state(continued, tmp_path):
    """checkpoint.load of the torch_dist checkpoint megatron-core saved after its step (model and
    optimizer): the run starts from its parameters, Adam moments and step count (Adam's and the
    schedule's), and says so."""
    import jax
    from conftest import SMALL
    from megajax.checkpoint.megatron import import_megatron_adam
    from megajax.checkpoint.stored_model import train_config
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup, initial_state
    save = continued[1] / "stepped"
    run = [o for o in SMALL if not o.startswith("model.")] + ["train.steps=1", "data.tokenizer=byte"]
    cfg = train_config(overrides=run + [f"checkpoint.load={save}", f"train.run_dir={tmp_path / 'a'}"])
    state, consumed, origin, resumed = initial_state(build_setup(make_plan(cfg, len(jax.devices()))))
    assert origin == (f"parameters from the Megatron checkpoint {save}, optimizer state from it (Adam moments, "
                      f"step count {ADAM_STEP + 1})") and consumed == 0 and resumed is None
    theirs = import_megatron_adam(save)
    assert_same_params(jax.tree.map(np.asarray, state.opt_state[0].mu), theirs["mu"])
    assert_same_params(jax.tree.map(np.asarray, state.opt_state[0].nu), theirs["nu"])
    assert int(state.opt_state[0].count) == int(state.opt_state[2].count) == ADAM_STEP + 1


def test_with_optimizer_needs_optimizer_state(saved, tmp_path, capsys):
    """--with-optimizer of a checkpoint without optimizer state (an import) or of a mixture-of-experts
    model: one paragraph naming what is missing."""
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.checkpoint.megatron import export_torch_dist
    from megajax.checkpoint.megatron_optimizer import AdamState
    cfg, params = saved["dense"][:2]
    step_dir = write_params_checkpoint(params, cfg, tmp_path / "imported", step=3)
    assert main(["export", "--format", "megatron", "--checkpoint", str(tmp_path / "imported"), "--output",
                 str(tmp_path / "out"), "--tokenizer", "byte", "--with-optimizer"]) != 0
    err = capsys.readouterr().err
    assert f"--with-optimizer: checkpoint {step_dir} holds no optimizer state (written by `megajax import`" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "imported"), "--output",
                 str(tmp_path / "hf"), "--tokenizer", "byte", "--with-optimizer"]) != 0
    assert "--with-optimizer writes the optimizer state for megatron-core: it applies to --format megatron, not to " \
           "--format hf" in capsys.readouterr().err
    moe_cfg, moe_params = saved["moe"][:2]
    with pytest.raises(CheckpointError, match=r"--with-optimizer: megajax writes megatron-core's optimizer state "
                                              r"for dense models"):
        export_torch_dist(DictSource(moe_params, moe_cfg.model), tmp_path / "moe", iteration=3,
                          adam=AdamState(None, None, 3, {}, {}, 0))
