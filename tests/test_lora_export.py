"""LoRA adapters out of and into the PyTorch world, judged by transformers and peft: a PEFT export
loads onto the Hugging Face export of its base, a merged export loads alone, both computing
megajax's logits (fp32, 1e-4); a PEFT import gives the adapters back exactly."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

from random_model import VOCAB, random_model
from megajax.checkpoint.manager import CheckpointSource, write_params_checkpoint
from megajax.checkpoint.source import flatten, unflatten
from megajax.cli import main
from megajax.config import load_config
from megajax.train.setup import base_reference
from megajax.train.state import build_model_spec

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def lora_checkpoint(tmp_path, family="llama", *overrides, targets=None, make=random_model):
    """(base step dir, LoRA step dir, spec with adapters, base params, adapters): a random base (`make`'s)
    and random adapters (A, B ~ N(0, 0.1)), saved as megajax checkpoints (the adapters naming the base)."""
    cfg, _, params = make(family, *overrides)
    base = write_params_checkpoint(params, cfg, tmp_path / "base")
    more = [f"model.lora.targets=[{','.join(targets)}]"] if targets else []
    lcfg = load_config(base={**cfg.to_dict(), "checkpoint": {"load": str(base)}}, overrides=LORA + more)
    spec, _ = build_model_spec(lcfg, lcfg.model.padded_vocab_size())
    rng = np.random.default_rng(3)
    adapters = unflatten({k: rng.normal(0, 0.1, x.shape).astype(np.float32) for k, x in flatten(spec.abstract_params)})
    lora = write_params_checkpoint(adapters, lcfg, tmp_path / "lora", meta={"lora_base": base_reference(lcfg)})
    return base, lora, spec, params, adapters


def megajax_logits(spec, params, toks, frozen=None):
    return np.asarray(spec.apply(params, toks, frozen=frozen))[..., :VOCAB]


def torch_logits(model, toks):
    import torch
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(toks).long()).logits.numpy()


@pytest.mark.parametrize("family, overrides", [("llama", ()), ("llama", ("model.qk_norm=true",))],
                         ids=["llama", "qwen3"])
def test_peft_and_merged_exports_match_megajax(tmp_path, family, overrides):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, lora, spec, params, adapters = lora_checkpoint(tmp_path, family, *overrides)
    toks = np.random.default_rng(1).integers(0, VOCAB, (2, 32)).astype(np.int32)
    want = megajax_logits(spec, adapters, toks, frozen=params)
    base_spec = random_model(family, *overrides)[1]
    assert np.abs(want - megajax_logits(base_spec, params, toks)).max() > 0.05  # the adapters matter

    assert main(["export", "--format", "hf", "--checkpoint", str(base), "--output", str(tmp_path / "hf"),
                 "--dtype", "fp32"]) == 0
    assert main(["export", "--format", "peft", "--checkpoint", str(lora), "--output", str(tmp_path / "peft"),
                 "--dtype", "fp32"]) == 0
    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(lora), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                 "v_proj"]
    stored = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    layer0 = "base_model.model.model.layers.0"
    assert stored[f"{layer0}.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert stored[f"{layer0}.self_attn.k_proj.lora_B.weight"].shape == (4 * 8, 4)  # 4 kv heads x head dim 8
    assert stored[f"{layer0}.mlp.down_proj.lora_A.weight"].shape == (4, 128)
    # The fused q/k/v adapter: three equal A's, B split; gate/up likewise.
    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        a = [stored[f"{layer0}.{m}.lora_A.weight"] for m in group]
        assert all(np.array_equal(a[0], x) for x in a)

    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base_model, tmp_path / "peft")
    np.testing.assert_allclose(torch_logits(with_adapter, toks)[..., :VOCAB], want, atol=1e-4, rtol=1e-4)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    np.testing.assert_allclose(torch_logits(merged, toks)[..., :VOCAB], want, atol=1e-4, rtol=1e-4)

    # Back into megajax: the same adapters, bit for bit.
    assert main(["import", "--format", "peft", "--input", str(tmp_path / "peft"), "--base", str(base),
                 "--output", str(tmp_path / "back")]) == 0
    back = CheckpointSource(tmp_path / "back")
    assert back.model.lora.rank == 4 and back.model.lora.alpha == 8.0
    assert sorted(back.names()) == sorted(dict(flatten(adapters)))
    for name, x in flatten(adapters):
        np.testing.assert_array_equal(back.get(name), x, err_msg=name)


def test_generate_with_an_adapter_equals_the_merged_model(tmp_path):
    """`megajax generate` on a base plus --adapter (a megajax LoRA checkpoint or a PEFT directory), or on the
    LoRA checkpoint alone, gives the greedy tokens of the merged model (its Hugging Face export, --hf)."""
    base, lora, *_ = lora_checkpoint(tmp_path)
    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(lora), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    assert main(["export", "--format", "peft", "--checkpoint", str(lora), "--output", str(tmp_path / "peft"),
                 "--dtype", "fp32"]) == 0

    def generate(*model):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.json"
        assert main(["generate", *model, "--prompt", "hello", "--prompt", "LoRA", "--max-new-tokens", "8",
                     "--json", str(out), "train.precision=fp32"]) == 0
        return [r["completion_ids"] for r in json.loads(out.read_text())]

    want = generate("--hf", str(tmp_path / "merged"))
    assert generate("--checkpoint", str(base), "--adapter", str(lora)) == want
    assert generate("--checkpoint", str(lora)) == want
    assert generate("--checkpoint", str(base), "--adapter", str(tmp_path / "peft")) == want
    assert generate("--checkpoint", str(base)) != want  # the adapters change the completions


def test_nemotron_h_peft_export_adapts_in_proj(tmp_path, capsys):
    """A hybrid 'M*-M*-' model's adapters (the Mamba mixers' in_proj, attention's and the MLP's) as PEFT's
    for NemotronHForCausalLM: the fused in_proj adapter is one lora_A and its lora_B in Hugging Face's
    [z | x | B | C | dt] order; peft on the transformers export computes megajax's logits and the import
    gives the adapters back exactly. With out_proj adapted too (PEFT refuses it on Mamba models: the
    export says so) the merged export computes megajax's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_hybrid_hf import HYBRID, hybrid_model
    make = lambda family, *o: hybrid_model(*o)  # noqa: E731  (the gated norms' weights near 1)
    toks = np.random.default_rng(1).integers(0, VOCAB, (2, 32)).astype(np.int32)
    plain = megajax_logits(hybrid_model(*HYBRID)[1], hybrid_model(*HYBRID)[2], toks)

    targets = ["in_proj", "qkv", "proj", "fc1", "fc2"]
    base, lora, spec, params, adapters = lora_checkpoint(tmp_path / "a", "llama", *HYBRID, targets=targets, make=make)
    want = megajax_logits(spec, adapters, toks, frozen=params)
    # The Mamba layers' adapters alone move the logits.
    mamba_only = unflatten({k: x if "in_proj_lora" in k else 0 * x for k, x in flatten(adapters)})
    assert np.abs(megajax_logits(spec, mamba_only, toks, frozen=params) - plain).max() > 0.05
    for args in (["--format", "hf", "--checkpoint", str(base), "--output", str(tmp_path / "hf")],
                 ["--format", "peft", "--checkpoint", str(lora), "--output", str(tmp_path / "peft")]):
        assert main(["export", *args, "--dtype", "fp32"]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "in_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                 "v_proj"]
    stored = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    mixer = "base_model.model.backbone.layers.0.mixer"
    assert stored[f"{mixer}.in_proj.lora_A.weight"].shape == (4, 64)
    assert stored[f"{mixer}.in_proj.lora_B.weight"].shape == (2 * 128 + 2 * 16 + 16, 4)  # z, x, B, C, dt rows
    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(base_model).__name__ == "NemotronHForCausalLM"
    with_adapter = peft.PeftModel.from_pretrained(base_model, tmp_path / "peft")
    np.testing.assert_allclose(torch_logits(with_adapter, toks)[..., :VOCAB], want, atol=1e-4, rtol=1e-4)
    assert main(["import", "--format", "peft", "--input", str(tmp_path / "peft"), "--base", str(base),
                 "--output", str(tmp_path / "back")]) == 0
    back = CheckpointSource(tmp_path / "back")
    assert sorted(back.model.lora.target_names()) == sorted(targets)
    assert sorted(back.names()) == sorted(dict(flatten(adapters)))
    for name, x in flatten(adapters):
        np.testing.assert_array_equal(back.get(name), x, err_msg=name)

    _, lora, spec, params, adapters = lora_checkpoint(tmp_path / "b", "llama", *HYBRID, make=make,
                                                      targets=["in_proj", "out_proj"])
    want = megajax_logits(spec, adapters, toks, frozen=params)
    out_only = unflatten({k: x if "out/lora" in k else 0 * x for k, x in flatten(adapters)})
    assert np.abs(megajax_logits(spec, out_only, toks, frozen=params) - plain).max() > 0.05
    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(lora), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    np.testing.assert_allclose(torch_logits(merged, toks)[..., :VOCAB], want, atol=1e-4, rtol=1e-4)
    capsys.readouterr()
    assert main(["export", "--format", "peft", "--checkpoint", str(lora), "--output", str(tmp_path / "no")]) == 2
    assert re.search(r"out_proj .*PEFT refuses LoRA on a Mamba model's out_proj.*--merge-lora", capsys.readouterr().err)
    assert not (tmp_path / "no").exists()


def test_expert_adapters_export_merged_and_refuse_peft(tmp_path, capsys):
    """The routed experts' adapters (`experts`: per expert, gate/up and fc2) merge into the Mixtral
    export, whose transformers model computes megajax's logits; PEFT's format, with no per-expert
    adapters, is refused naming the target."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    moe = ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32"]
    base, lora, spec, params, adapters = lora_checkpoint(tmp_path, "llama", *moe, targets=["qkv", "experts"])
    assert sorted(k for k in dict(flatten(adapters)) if "experts" in k) == [
        "layers/mlp/experts_fc1_lora/a", "layers/mlp/experts_fc1_lora/b", "layers/mlp/experts_fc2_lora/a",
        "layers/mlp/experts_fc2_lora/b"]
    toks = np.random.default_rng(1).integers(0, VOCAB, (2, 32)).astype(np.int32)
    want = megajax_logits(spec, adapters, toks, frozen=params)
    experts_only = unflatten({k: x if "experts_fc" in k else 0 * x for k, x in flatten(adapters)})
    assert np.abs(megajax_logits(spec, experts_only, toks, frozen=params)
                  - megajax_logits(random_model("llama", *moe)[1], params, toks)).max() > 0.05
    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(lora), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    np.testing.assert_allclose(torch_logits(merged, toks)[..., :VOCAB], want, atol=1e-4, rtol=1e-4)
    capsys.readouterr()
    assert main(["export", "--format", "peft", "--checkpoint", str(lora), "--output", str(tmp_path / "no")]) == 2
    assert re.search(r"model.lora.targets holds experts .*PEFT's LoRA format has no per-expert adapters.*"
                     r"--merge-lora", capsys.readouterr().err)
    assert not (tmp_path / "no").exists()
