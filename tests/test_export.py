"""Export to / import from Hugging Face and Megatron-Core checkpoints, judged by the real libraries.

transformers loads our Hugging Face exports and megatron-core's own GPTModel
loads our Megatron exports; both must compute megajax's logits. Importers must
give back the exact parameters.
"""

import argparse
import datetime
import json
import os
import socket
import struct
import subprocess
import sys
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from random_model import VOCAB, random_model  # noqa: E402
from megajax.checkpoint.common import model_overrides  # noqa: E402
from megajax.checkpoint.hf import export_hf, import_hf  # noqa: E402
from megajax.checkpoint.megatron import export_megatron, import_megatron  # noqa: E402
from megajax.checkpoint.source import DictSource, flatten, unflatten  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.data.tokenizer import ByteTokenizer  # noqa: E402
from megajax.errors import CheckpointError  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402

SEQ = 16


def make_model(family="llama", *overrides, seed=0):
    """(config, spec, params): the shared tiny random model (tests/random_model.py: N(0, 0.05), seq_len 32)
    with `overrides`. Cached: do not mutate."""
    return random_model(family, *overrides, seed=seed)


def tokens(batch=2, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ)).astype(np.int32)


def megajax_logits(spec, params, toks):
    return np.asarray(spec.apply(params, toks))[..., :VOCAB]


def hf_logits(path, toks):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(toks).long()).logits.numpy()


def assert_same_params(got, want):
    got, want = dict(flatten(got)), dict(flatten(want))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def assert_round_trip(imported, cfg, spec, params, toks):
    """An import gives back the architecture, exactly the parameters, and so exactly the logits."""
    overrides_back, params_back = imported
    assert overrides_back == model_overrides(cfg.model)
    assert_same_params(params_back, params)
    cfg_back = load_config(base={"model": overrides_back}, overrides=["train.seq_len=32"])
    spec_back, _ = build_model_spec(cfg_back, cfg_back.model.padded_vocab_size())
    np.testing.assert_array_equal(megajax_logits(spec_back, params_back, toks), megajax_logits(spec, params, toks))


def safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


# ----------------------------------------------------------------------------
# Hugging Face
# ----------------------------------------------------------------------------

HF_CASES = {
    "llama-gqa": ("llama", []),
    "llama3-rope-tied-bias": ("llama", ["model.rope_scaling=llama3", "model.rope_theta=500000.0",
                                        "model.tie_embeddings=true", "model.use_bias=true"]),
    "gpt2": ("gpt", []),
    # Every layer is MoE: the dense ffn size is unused, and an import sets it to the experts'.
    "mixtral": ("llama", ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                          "model.ffn_hidden_size=32"]),
    # Qwen3: q/k norms, head_dim 16 (not hidden / heads = 8), tied embeddings (as Qwen3-0.6B).
    "qwen3": ("llama", ["model.qk_norm=true", "model.head_dim=16", "model.tie_embeddings=true"]),
    # Qwen3-MoE: layer 0 MoE, layer 1 dense (Qwen's mlp_only_layers), pre-softmax routing
    # (norm_topk_prob=false).
    "qwen3-moe": ("llama", ["model.qk_norm=true", "model.head_dim=16", "model.num_experts=4",
                            "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "model.moe_layer_freq=2",
                            "model.moe_router_pre_softmax=true"]),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_export_matches_transformers(case, tmp_path):
    pytest.importorskip("transformers")
    family, overrides = HF_CASES[case]
    cfg, spec, params = make_model(family, *overrides)
    sharded = case == "llama-gqa"
    out = export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec="byte", dtype="fp32",
                    **({"max_shard_bytes": 60_000} if sharded else {}))
    files = sorted(p.name for p in out.iterdir())
    if sharded:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert set(shards) <= set(files) and "model.safetensors" not in files
    else:
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    toks = tokens()
    np.testing.assert_allclose(hf_logits(out, toks), megajax_logits(spec, params, toks), atol=1e-4, rtol=1e-4)

    assert_round_trip(import_hf(out), cfg, spec, params, toks)


def test_hf_tokenizer_matches_byte_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg, _, params = make_model("gpt")
    out = export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec="byte", dtype="bf16")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "Hello, world!  ça va? 日本語 .\n\tdef f(x): return x ** 2  # 🙂"
    ids = tok(text)["input_ids"]
    assert ids == ByteTokenizer().encode(text)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == ByteTokenizer.eod_id == 256
    assert tok.decode(ids + [256]) == text + "<|endoftext|>"
    # bf16 export: the stored dtype is bf16 and the config says so
    header = safetensors_header(out / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["vocab_size"] == VOCAB
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256


def test_hf_export_copies_a_tokenizer_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megajax.data.tokenizer import byte_tokenizer_json
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(byte_tokenizer_json())
    cfg, _, params = make_model("llama")
    out = export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec=str(tok_dir))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("abc")["input_ids"] == [97, 98, 99] and tok.eos_token == "<|endoftext|>"


class CountingSource(DictSource):
    """A DictSource that records how many tensors it handed out are still alive at each read."""

    def __init__(self, params, model):
        super().__init__(params, model)
        self.alive: list[weakref.ref] = []
        self.most_alive = 0

    def get(self, name, layer=None):
        self.alive = [r for r in self.alive if r() is not None]
        self.most_alive = max(self.most_alive, len(self.alive))
        x = np.array(super().get(name, layer))  # a fresh array the caller owns
        self.alive.append(weakref.ref(x))
        return x


def test_hf_export_streams_one_tensor_at_a_time(tmp_path):
    import tracemalloc
    # ~11 MB of fp32 parameters in 4 layers; the largest single tensor is ~1 MB.
    cfg, _, params = make_model("gpt", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
                                "model.ffn_hidden_size=1024")
    source = CountingSource(params, cfg.model)
    largest = max(x.nbytes // (x.shape[0] if name.startswith("layers/") else 1)
                  for name, x in flatten(params))
    total = sum(x.nbytes for _, x in flatten(params))
    tracemalloc.start()
    export_hf(source, tmp_path / "hf", tokenizer_spec="byte", dtype="bf16", max_shard_bytes=2_000_000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # c_attn concatenates q, k and v of one layer: at most two earlier reads alive during the third.
    assert source.most_alive <= 2, source.most_alive
    assert peak < 5 * largest < total / 2, (peak, largest, total)


def test_hf_export_errors(tmp_path):
    cfg, _, params = make_model("gpt", "model.num_kv_heads=4", "model.norm=rmsnorm")
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*norm=rmsnorm \(needs layernorm\).*"
                                              r"num_kv_heads=4 \(needs num_kv_heads = num_heads = 8"):
        export_hf(DictSource(params, cfg.model), tmp_path / "a", tokenizer_spec="byte")
    cfg, _, params = make_model("llama")
    flat = dict(flatten(params))
    del flat["layers/mlp/up/kernel"]
    with pytest.raises(CheckpointError, match="missing tensors layers/mlp/up/kernel"):
        export_hf(DictSource(unflatten(flat), cfg.model), tmp_path / "b", tokenizer_spec="byte")
    flat = dict(flatten(params))
    flat["layers/attn/q/kernel"] = flat["layers/attn/q/kernel"][:, :32]
    with pytest.raises(CheckpointError, match=r"layers/attn/q/kernel has shape \[2, 32, 8, 8\].*\[2, 64, 8, 8\]"):
        export_hf(DictSource(unflatten(flat), cfg.model), tmp_path / "c", tokenizer_spec="byte")
    assert not any(p.name != "tok" for p in tmp_path.iterdir())  # nothing half-written
    small = load_config(overrides=["model.vocab_size=100", "train.seq_len=32", "model.num_layers=2",
                                   "model.hidden_size=64", "model.num_heads=8", "model.ffn_hidden_size=128"])
    spec, _ = build_model_spec(small, small.model.padded_vocab_size())
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), spec.abstract_params)
    with pytest.raises(CheckpointError, match="tokenizer 'byte' has 257 ids, more than the model's vocab_size=100"):
        export_hf(DictSource(zeros, small.model), tmp_path / "d", tokenizer_spec="byte")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "x").write_text("")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        export_hf(DictSource(params, cfg.model), tmp_path / "e", tokenizer_spec="byte")


def test_hf_import_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a Hugging Face model directory"):
        import_hf(tmp_path)
    cfg, _, params = make_model("llama")
    out = export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec="byte", dtype="fp32")
    config = json.loads((out / "config.json").read_text())

    def expect(change, match):
        (out / "config.json").write_text(json.dumps(dict(config, **change)))
        with pytest.raises(CheckpointError, match=match):
            import_hf(out)

    expect({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
           "architecture 'MistralForCausalLM'.*not supported")
    expect({"hidden_act": "gelu"}, "hidden_act='gelu'.*accepted: silu")
    expect({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
           "rope type 'yarn' is not supported")
    expect({"intermediate_size": 96}, r"model.layers.0.mlp.gate_proj.weight .* has shape \[128, 64\].*\[96, 64\]")
    expect({"num_hidden_layers": 3}, "gives the model 3 layers .* but its weights hold layers 0 to 1")
    expect({"num_hidden_layers": 1}, "tensors megajax does not know: model.layers.1")


# ----------------------------------------------------------------------------
# Megatron-Core
# ----------------------------------------------------------------------------

WORKER = os.path.join(os.path.dirname(__file__), "megatron_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_core_logits(step_dir, toks, world, tmp_path, save_dir=None):
    """Logits of megatron-core's GPTModel loading the checkpoint, one gloo process per tensor (and expert)
    rank; with `save_dir`, its state dicts saved back there as a legacy checkpoint."""
    np.save(tmp_path / "tokens.npy", toks)
    out, port = tmp_path / "logits.npy", free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, str(step_dir), str(tmp_path / "tokens.npy"), str(out),
                               str(rank), str(world), str(port), *([str(save_dir)] if save_dir else [])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return np.load(out)


MEGATRON_CASES = {
    # llama: swiglu, rmsnorm, rope, GQA (8 heads, 4 groups), untied output layer
    "llama-tp1": ("llama", [], 1, 1),
    "llama3-tp2-pp2": ("llama", ["model.rope_scaling=llama3", "model.rope_theta=500000.0"], 2, 2),
    # gpt: learned positions, layernorm, exact gelu, biases, tied embeddings (copied to the last stage)
    "gpt-tp2-pp2": ("gpt", [], 2, 2),
    # mixture of experts: router, per-expert linear_fc1 [gate; up] and linear_fc2, expert tensor parallelism
    "mixtral-tp2": ("llama", ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                              "model.ffn_hidden_size=32"], 2, 1),
    # + a shared expert: shared_experts.linear_fc1 [gate; up] per tensor rank and linear_fc2, split like a dense MLP
    "moe-shared-tp2": ("llama", ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                                 "model.ffn_hidden_size=32", "model.moe_shared_expert_ffn_size=48"], 2, 1),
    # MoE layers 0 and 2 with group-limited routing (8 experts in 4 groups, top-4 within each token's 2 best
    # groups) and a gated shared expert (shared_experts.gate_weight [1, hidden], replicated); dense MLPs
    # (ffn_hidden_size 96) in layers 1 and 3: moe_layer_freq 2
    "moe-freq2-groups-gated-shared-tp2": ("llama", [
        "model.num_layers=4", "model.num_experts=8", "model.moe_router_topk=4", "model.moe_ffn_hidden_size=32",
        "model.ffn_hidden_size=96", "model.moe_layer_freq=2", "model.moe_router_num_groups=4",
        "model.moe_router_group_topk=2", "model.moe_shared_expert_ffn_size=48", "model.moe_shared_expert_gate=true"],
        2, 1),
    # Qwen3-MoE: q_layernorm / k_layernorm (head_dim 16, replicated over tensor ranks), pre-softmax routing,
    # layer 0 MoE and layer 1 dense
    "qwen3-moe-tp2": ("llama", list(HF_CASES["qwen3-moe"][1]), 2, 1),
}


@pytest.mark.parametrize("case", MEGATRON_CASES)
def test_megatron_export_matches_megatron_core(case, tmp_path):
    pytest.importorskip("megatron.core")
    family, overrides, tp, pp = MEGATRON_CASES[case]
    cfg, spec, params = make_model(family, *overrides)
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=tp,
                          pipeline_parallel=pp, dtype="fp32", iteration=7)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    step = out / "iter_0000007"
    want_dirs = {f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") for t in range(tp) for s in range(pp)}
    assert {p.name for p in step.iterdir()} == want_dirs
    toks = tokens()
    logits = megatron_core_logits(step, toks, tp, tmp_path)
    assert logits.shape == (2, SEQ, cfg.model.megatron_padded_vocab_size(tp))
    np.testing.assert_allclose(logits[..., :VOCAB], megajax_logits(spec, params, toks), atol=1e-4, rtol=1e-4)

    assert_round_trip(import_megatron(out), cfg, spec, params, toks)  # shards merged back exactly
    if "shared" in case:
        torch = pytest.importorskip("torch")
        saved = torch.load(step / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        assert (saved["args"].moe_shared_expert_intermediate_size, saved["args"].moe_shared_expert_gate,
                saved["args"].moe_shared_expert_overlap) == (48, "gate" in case, False)
        assert saved["model"]["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (48, 64)  # 2 x 48 / tp
        gate = saved["model"].get("decoder.layers.0.mlp.shared_experts.gate_weight")
        assert (gate is not None and tuple(gate.shape) == (1, 64)) == ("gate" in case)  # replicated, not split
    if "groups" in case:  # the groups change these tokens' routing: megatron-core applied them too
        _, plain_spec, plain_params = make_model(family, *(o for o in overrides if "group" not in o))
        assert np.abs(megajax_logits(plain_spec, plain_params, toks) - logits[..., :VOCAB]).max() > 1e-3
    if "freq2" in case:
        torch = pytest.importorskip("torch")
        saved = torch.load(step / "mp_rank_01" / "model_optim_rng.pt", weights_only=False)
        assert saved["args"].moe_layer_freq == 2
        assert saved["model"]["decoder.layers.1.mlp.linear_fc1.weight"].shape == (96, 64)  # [gate; up] 2 x 96 / tp
        assert "decoder.layers.2.mlp.router.weight" in saved["model"]
        assert not any(k.startswith(("decoder.layers.1.mlp.router", "decoder.layers.2.mlp.linear_fc1"))
                       for k in saved["model"])


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2)])
def test_legacy_expert_parallel_round_trip_through_megatron_core(tp, ep, tmp_path):
    """`--expert-parallel`: rank folders mp_rank_TT_EEE, each with its expert rank's experts numbered from 0
    and the dense tensors of its tensor rank; megatron-core's GPTModel at TP x EP loads each strictly and
    computes megajax's logits, and what it saves back (its own state dicts, one per rank) imports exactly."""
    pytest.importorskip("megatron.core")
    torch = pytest.importorskip("torch")
    cfg, spec, params = make_model("llama", *MEGATRON_CASES["mixtral-tp2"][1])
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=tp, expert_parallel=ep,
                          dtype="fp32", iteration=7)
    step = out / "iter_0000007"
    assert {p.name for p in step.iterdir()} == {f"mp_rank_{t:02d}_{e:03d}" for t in range(tp) for e in range(ep)}
    saved = torch.load(step / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert saved["args"].expert_model_parallel_size == ep
    assert sorted({k.split("local_experts.")[1].split(".")[0] for k in saved["model"] if "local_experts" in k}) \
        == ["0", "1"]  # 4 experts over 2 expert ranks
    want = np.asarray(params["layers"]["mlp"]["fc2"][0, 2]).T  # layer 0's expert 2, [hidden, ffn]
    got = saved["model"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].numpy()
    np.testing.assert_array_equal(got, want[:, :want.shape[1] // tp])  # expert rank 1's first; row-parallel
    toks = tokens()
    logits = megatron_core_logits(step, toks, tp * ep, tmp_path, save_dir=tmp_path / "back")
    np.testing.assert_allclose(logits[..., :VOCAB], megajax_logits(spec, params, toks), atol=1e-4, rtol=1e-4)
    assert_round_trip(import_megatron(out), cfg, spec, params, toks)
    assert_round_trip(import_megatron(tmp_path / "back"), cfg, spec, params, toks)


def test_legacy_expert_tensor_1_round_trip_through_megatron_core(tmp_path):
    """`--expert-tensor-parallel 1` at TP 2 x EP 2 (MoE parallel folding): the rank files Megatron's writers
    hold (mp_rank_00_000 and mp_rank_01_001: tensor rank i mod 2, expert rank i), each expert whole;
    megatron-core's GPTModel on 2 processes with expert_tensor_parallel_size 1 loads each strictly and
    computes megajax's logits, and what it saves back imports exactly."""
    pytest.importorskip("megatron.core")
    torch = pytest.importorskip("torch")
    cfg, spec, params = make_model("llama", *MEGATRON_CASES["mixtral-tp2"][1])
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=2, expert_parallel=2,
                          expert_tensor_parallel=1, dtype="fp32", iteration=7)
    step = out / "iter_0000007"
    assert {p.name for p in step.iterdir()} == {"mp_rank_00_000", "mp_rank_01_001"}
    saved = torch.load(step / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert saved["args"].expert_tensor_parallel_size == 1
    want = np.asarray(params["layers"]["mlp"]["fc2"][0, 2]).T  # layer 0's expert 2, [hidden, ffn], whole
    np.testing.assert_array_equal(
        saved["model"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].numpy(), want)
    toks = tokens()
    logits = megatron_core_logits(step, toks, 2, tmp_path, save_dir=tmp_path / "back")
    np.testing.assert_allclose(logits[..., :VOCAB], megajax_logits(spec, params, toks), atol=1e-4, rtol=1e-4)
    assert_round_trip(import_megatron(out), cfg, spec, params, toks)
    assert {p.name for p in (tmp_path / "back" / "iter_0000001").iterdir()} == {"mp_rank_00_000", "mp_rank_01_001"}
    assert_round_trip(import_megatron(tmp_path / "back"), cfg, spec, params, toks)


def test_hf_export_refuses_a_shared_expert(tmp_path):
    """Mixtral has no shared expert: one error naming the key and the export that keeps it, nothing written."""
    cfg, _, params = make_model("llama", *MEGATRON_CASES["moe-shared-tp2"][1])
    with pytest.raises(CheckpointError, match=r"MixtralForCausalLM, which cannot express "
                                              r"model.moe_shared_expert_ffn_size=48 \(needs 0.*--format megatron"):
        export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec="byte")
    assert not (tmp_path / "hf").exists()


def test_megatron_gelu_shared_expert_round_trips(tmp_path):
    """GELU experts: the shared expert's linear_fc1 holds fc1 alone; tensor shards merge back exactly.
    args saying the shared expert is gated while the files hold no gate: the missing tensor named."""
    torch = pytest.importorskip("torch")
    cfg, spec, params = make_model("llama", *MEGATRON_CASES["moe-shared-tp2"][1], "model.activation=gelu")
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=2, dtype="fp32",
                          iteration=1)
    assert_round_trip(import_megatron(out), cfg, spec, params, tokens())
    rank0 = out / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(rank0, weights_only=False)
    assert saved["model"]["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (24, 64)
    torch.save(dict(saved, args=argparse.Namespace(**dict(vars(saved["args"]), moe_shared_expert_gate=True))), rank0)
    with pytest.raises(CheckpointError, match=r"has no decoder.layers.0.mlp.shared_experts.gate_weight"):
        import_megatron(out)
    odd, _, odd_params = make_model("llama", *MEGATRON_CASES["moe-shared-tp2"][1], "model.moe_shared_expert_ffn_size=36")
    with pytest.raises(CheckpointError, match="model.moe_shared_expert_ffn_size=36 is not divisible by tensor_parallel=8"):
        export_megatron(DictSource(odd_params, odd.model), tmp_path / "odd", tensor_parallel=8)


def test_megatron_bf16_export_and_release(tmp_path):
    torch = pytest.importorskip("torch")
    import ml_dtypes
    cfg, _, params = make_model("llama")
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc")  # bf16, release
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    saved = torch.load(out / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert saved["checkpoint_version"] == 3.0 and saved["args"].bf16
    assert saved["model"]["decoder.layers.0.mlp.linear_fc1.weight"].dtype == torch.bfloat16
    assert saved["model"]["decoder.layers.0.mlp.linear_fc1._extra_state"] is None
    _, params_back = import_megatron(out)
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    assert_same_params(params_back, rounded)


def test_megatron_errors(tmp_path):
    torch = pytest.importorskip("torch")
    cfg, _, params = make_model("llama")
    source = DictSource(params, cfg.model)
    with pytest.raises(CheckpointError, match="model.num_kv_heads=4 is not divisible by tensor_parallel=8"):
        export_megatron(source, tmp_path / "a", tensor_parallel=8)
    with pytest.raises(CheckpointError, match="model.num_layers=2 is not divisible by pipeline_parallel=3"):
        export_megatron(source, tmp_path / "a", pipeline_parallel=3)
    with pytest.raises(CheckpointError, match="iteration=0: Megatron's loader needs an iteration >= 1"):
        export_megatron(source, tmp_path / "a", iteration=0)
    with pytest.raises(CheckpointError, match="not a Megatron checkpoint"):
        import_megatron(tmp_path)

    out = export_megatron(source, tmp_path / "mc", tensor_parallel=2, dtype="fp32", iteration=3)
    rank0 = out / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(rank0, weights_only=False)

    def expect(change, match):
        args = argparse.Namespace(**dict(vars(saved["args"]), **change))
        torch.save(dict(saved, args=args), rank0)
        with pytest.raises(CheckpointError, match=match):
            import_megatron(out)

    expect({"openai_gelu": True}, "openai_gelu=True cannot be represented")
    expect({"position_embedding_type": "yarn"}, "position_embedding_type='yarn' cannot be represented")
    expect({"ffn_hidden_size": 96}, r"linear_fc1.weight \(gate\) has shape \[128, 64\].*imply \[96, 64\]")
    expect({"tensor_model_parallel_size": 4}, r"tensor_model_parallel_size=4.*rank files present are "
                                              r"\['mp_rank_00', 'mp_rank_01'\]")
    torch.save(dict(saved, when=datetime.date(2024, 1, 1)), rank0)
    with pytest.raises(CheckpointError, match=r"a Python object of datetime.date, which is neither Megatron's nor "
                                              r"one of PyTorch's checkpoint classes.*pass --trust-checkpoint"):
        import_megatron(out)
    import_megatron(out, trust=True)
    rank0.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="is not a readable torch checkpoint file"):
        import_megatron(out)
    torch.save(saved, rank0)
    (out / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointError, match="rank files present are \\['mp_rank_00'\\]"):
        import_megatron(out)


def word_tokenizer_dir(path, size=200):
    """A Hugging Face tokenizer.json (word level, `size` ids, the last `<|endoftext|>`) in directory `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{k}": k for k in range(size - 2)} | {"[UNK]": size - 2, "<|endoftext|>": size - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


def test_megatron_export_records_the_tokenizer_megatron_loads(tmp_path):
    """args name a HuggingFaceTokenizer in `tokenizer/` beside the checkpoint; megatron-core's own
    build_tokenizer loads it with megajax's ids, and the importer finds it again after a move."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    from megajax.checkpoint.megatron import megatron_tokenizer
    from megajax.data.tokenizer import load_tokenizer
    cfg, _, params = make_model("llama")
    tok_dir = word_tokenizer_dir(tmp_path / "tok")
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tokenizer_spec=str(tok_dir))
    args = torch.load(out / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["args"]
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model == str(out / "tokenizer")
    theirs = build_tokenizer(args)
    ours = load_tokenizer(str(tok_dir))
    text = "w3 w17 w150 nope w0"
    assert theirs.tokenize(text) == ours.encode(text) == [3, 17, 150, 198, 0]
    assert theirs.vocab_size == 200 and theirs.eod == ours.eod_id == 199

    moved = out.rename(tmp_path / "moved")
    assert megatron_tokenizer(moved)[0] == str(moved / "tokenizer")
    byte = export_megatron(DictSource(params, cfg.model), tmp_path / "mc-byte", tokenizer_spec="byte")
    assert build_tokenizer(torch.load(byte / "release" / "mp_rank_00" / "model_optim_rng.pt",
                                      weights_only=False)["args"]).tokenize("héllo") == list("héllo".encode())
    assert megatron_tokenizer(byte)[0] == "byte"


def test_import_without_a_tokenizer_is_not_called_byte(tmp_path):
    from megajax.checkpoint.common import imported_tokenizer
    from megajax.checkpoint.megatron import megatron_tokenizer
    cfg, _, params = make_model("llama")
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc")  # no tokenizer recorded
    found, known = megatron_tokenizer(out)
    assert found is None and "no tokenizer_type" in known
    assert imported_tokenizer(found, 257, known) == ("byte", None)  # the byte tokenizer's vocabulary
    spec, warning = imported_tokenizer(found, 2000, known)
    assert spec != "byte" and "no tokenizer_type" in spec
    assert "2000 ids" in warning and "data.tokenizer=PATH" in warning and "--tokenizer PATH" in warning


def test_format_tables_refuse_a_parameter_they_have_no_row_for():
    """A parameter the model gains (here a MoE router) without a row in a format is named, not dropped."""
    from megajax.checkpoint.hf import GPT2_ROWS, LLAMA_ROWS
    from megajax.checkpoint.mapping import rows_for
    from megajax.checkpoint.megatron import MEGATRON_ROWS
    from megajax.models.layout import param_shapes
    for family, tables in (("llama", (LLAMA_ROWS, MEGATRON_ROWS)), ("gpt", (GPT2_ROWS, MEGATRON_ROWS))):
        shapes = param_shapes(make_model(family)[0].model)
        assert shapes == {name: x.shape for name, x in flatten(make_model(family)[1].abstract_params)}
        for table in tables:
            assert {p.path for row in rows_for(table, shapes, "x") for p in row.parts} == set(shapes)
            with pytest.raises(CheckpointError, match="no place for the parameters layers/mlp/router/kernel"):
                rows_for(table, dict(shapes, **{"layers/mlp/router/kernel": (2, 64, 4)}), "x")


def test_transformers_saved_mixtral_imports_with_its_logits(tmp_path):
    """A MixtralForCausalLM saved by transformers itself imports and computes transformers' logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, rope_theta=10000.0)
    model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    overrides, params = import_hf(tmp_path / "hf")
    assert (overrides["num_experts"], overrides["moe_router_topk"], overrides["moe_ffn_hidden_size"]) == (4, 2, 16)
    cfg = load_config(base={"model": overrides}, overrides=["train.seq_len=32"])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    toks = tokens()
    np.testing.assert_allclose(megajax_logits(spec, params, toks), hf_logits(tmp_path / "hf", toks),
                               atol=1e-4, rtol=1e-4)


def test_transformers_saved_qwen3_moe_imports_with_its_logits_and_round_trips(tmp_path):
    """A Qwen3MoeForCausalLM saved by transformers itself (per-expert tensors, norm_topk_prob, head_dim
    other than hidden / heads) imports with transformers' logits, and exports back to the same tensors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                                         max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so that a dropped q/k norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved  # the Hub's per-expert layout
    overrides, params = import_hf(tmp_path / "hf")
    assert (overrides["qk_norm"], overrides["head_dim"], overrides["moe_layer_freq"],
            overrides["moe_router_pre_softmax"], overrides["moe_ffn_hidden_size"]) == (True, 16, 1, False, 16)
    cfg = load_config(base={"model": overrides}, overrides=["train.seq_len=32"])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    toks = tokens()
    np.testing.assert_allclose(megajax_logits(spec, params, toks), hf_logits(tmp_path / "hf", toks),
                               atol=1e-4, rtol=1e-4)
    out = export_hf(DictSource(params, cfg.model), tmp_path / "back", tokenizer_spec="byte", dtype="fp32")
    back = load_file(str(out / "model.safetensors"))
    assert sorted(back) == sorted(saved)
    for name, x in saved.items():
        np.testing.assert_array_equal(back[name], x, err_msg=name)


def test_qwen3_moe_import_refuses_a_layer_pattern_moe_layer_freq_cannot_express(tmp_path):
    """Qwen's decoder_sparse_step=2 makes layers 1, 3 MoE; megajax's moe_layer_freq makes 0, 2: refused by name."""
    cfg, _, params = make_model("llama", *HF_CASES["qwen3-moe"][1])
    out = export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec="byte", dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    assert (config["mlp_only_layers"], config["decoder_sparse_step"], config["norm_topk_prob"]) == ([1], 1, False)
    (out / "config.json").write_text(json.dumps(dict(config, mlp_only_layers=[], decoder_sparse_step=2)))
    with pytest.raises(CheckpointError, match=r"decoder_sparse_step=2, mlp_only_layers=\[\] make layers \[1\]"):
        import_hf(out)


# DeepSeek-V3 style routing: sigmoid scores, an expert bias steering the top-k, scaled weights.
SIGMOID_BIAS = ("model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                "model.ffn_hidden_size=32", "model.moe_router_score_function=sigmoid",
                "model.moe_router_bias_update_rate=0.001", "model.moe_router_topk_scaling_factor=2.5")


def sigmoid_bias_model():
    """(config, spec, params, expert bias [layers, E], params with the bias as exporters name it)."""
    cfg, spec, params = make_model("llama", *SIGMOID_BIAS)
    bias = np.random.default_rng(5).normal(0.0, 0.2, (2, 4)).astype(np.float32)
    with_bias = unflatten({**dict(flatten(params)), "layers/mlp/expert_bias": bias})
    return cfg, spec, params, bias, with_bias


def test_megatron_export_of_sigmoid_routing_with_expert_bias(tmp_path):
    """megatron-core's router (sigmoid, expert bias, top-k scaling) computes megajax's logits from the
    export, and the import gives back the bias and the routing keys."""
    pytest.importorskip("megatron.core")
    cfg, spec, params, bias, with_bias = sigmoid_bias_model()
    toks = tokens()
    want = np.asarray(spec.apply(params, toks, expert_bias=bias))[..., :VOCAB]
    unbiased = np.asarray(spec.apply(params, toks, expert_bias=np.zeros_like(bias)))[..., :VOCAB]
    assert np.abs(want - unbiased).max() > 1e-3  # the bias changes the routing of these tokens
    out = export_megatron(DictSource(with_bias, cfg.model), tmp_path / "mc", tensor_parallel=2, dtype="fp32",
                          iteration=1)
    args = __import__("torch").load(out / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt",
                                    weights_only=False)["args"]
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_router_bias_update_rate,
            args.moe_router_topk_scaling_factor) == ("sigmoid", True, 0.001, 2.5)
    logits = megatron_core_logits(out / "iter_0000001", toks, 2, tmp_path)
    np.testing.assert_allclose(logits[..., :VOCAB], want, atol=1e-4, rtol=1e-4)

    overrides_back, params_back = import_megatron(out)
    assert overrides_back == model_overrides(cfg.model)
    assert (overrides_back["moe_router_score_function"], overrides_back["moe_router_bias_update_rate"],
            overrides_back["moe_router_topk_scaling_factor"]) == ("sigmoid", 0.001, 2.5)
    assert_same_params(params_back, with_bias)


def test_hf_export_refuses_sigmoid_routing_and_expert_bias(tmp_path):
    cfg, _, _, _, with_bias = sigmoid_bias_model()
    with pytest.raises(CheckpointError, match=r"moe_router_score_function=sigmoid \(needs softmax\).*"
                                              r"moe_router_topk_scaling_factor=2.5.*moe_router_bias_update_rate=0.001"
                                              r".*--format megatron"):
        export_hf(DictSource(with_bias, cfg.model), tmp_path / "hf", tokenizer_spec="byte")
    assert not (tmp_path / "hf").exists()


def test_megatron_bf16_export_keeps_the_expert_bias_fp32(tmp_path):
    torch = pytest.importorskip("torch")
    cfg, _, _, bias, with_bias = sigmoid_bias_model()
    out = export_megatron(DictSource(with_bias, cfg.model), tmp_path / "mc")  # bf16, release
    saved = torch.load(out / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["model"]
    assert saved["decoder.layers.0.mlp.router.weight"].dtype == torch.bfloat16
    for i in range(2):
        got = saved[f"decoder.layers.{i}.mlp.router.expert_bias"]
        assert got.dtype == torch.float32
        np.testing.assert_array_equal(got.numpy(), bias[i])
