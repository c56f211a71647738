"""LoRA runs end to end: a resume keeps the adapters it resumes (another rank, alpha or targets, LoRA switched
off or on, is refused naming what changed; dropout may change, noted), checkpoint.load of a LoRA checkpoint
is refused with the ways to go on, the exact-match score of a LoRA run is the merged model's, and an adapter
trained from a Hugging Face directory goes out as PEFT and comes back (with the directory as its base,
named or not) computing what the run computes; its base saved over afterwards is refused everywhere."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import SMALL  # noqa: E402
from random_model import random_weights  # noqa: E402
from test_bad_input import megajax, paragraph  # noqa: E402
from megajax.checkpoint.manager import CheckpointSource, write_params_checkpoint  # noqa: E402
from megajax.checkpoint.source import unflatten  # noqa: E402
from megajax.checkpoint.stored_model import train_config  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.train.loop import train  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
RUN = [*SMALL, "train.precision=fp32", "optim.lr=1e-2", "optim.decay_steps=8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full run (2 steps) and a LoRA run on its checkpoint (2 steps), one device."""
    tmp = tmp_path_factory.mktemp("lora-resume")
    one = jax.devices()[:1]
    train(load_config(overrides=[*RUN, "train.steps=2", f"train.run_dir={tmp / 'base'}"]), one)
    train(load_config(overrides=[*RUN, *LORA, "train.steps=2", f"train.run_dir={tmp / 'lora'}",
                                 f"checkpoint.load={tmp / 'base'}"]), one)
    return tmp


def resume(runs, run: str, *overrides: str):
    args = [*RUN, "train.steps=3", f"train.run_dir={runs / run}", *overrides]
    return megajax("train", *args)


@pytest.mark.parametrize("run, overrides, words", [
    ("lora", ["model.lora.rank=8", "model.lora.alpha=8"], ["model.lora.rank 4 -> 8", "the trained A and B have rank 4"]),
    ("lora", ["model.lora.rank=4", "model.lora.alpha=16"], ["model.lora.alpha 8 -> 16", "scale alpha / rank"]),
    ("lora", [*LORA, "model.lora.targets=[qkv,proj]"], ["model.lora.targets [qkv,proj,fc1,fc2] -> [qkv,proj]",
                                                        "the trained adapters of fc1, fc2 would be dropped"]),
    ("lora", [*LORA, "model.lora.targets=[linear_fc2,linear_fc1,linear_proj,linear_qkv]"], []),  # the same targets: not refused
    ("lora", [], ["holds LoRA adapters (rank 4, alpha 8, targets [qkv,proj,fc1,fc2])", "model.lora unset",
                  "--merge-lora"]),
    ("base", LORA, ["holds a full model's training state (model.lora unset)", "checkpoint.load="]),
], ids=["rank", "alpha", "targets", "same-targets-spelled-otherwise", "lora-off", "lora-on"])
def test_a_resume_that_changes_the_adapters_is_refused(runs, run, overrides, words):
    before = {p: p.stat().st_mtime_ns for p in (runs / run / "checkpoints").rglob("*")}
    base = [f"checkpoint.load={runs / 'base'}"] if run == "lora" and overrides else []
    if not words:  # stops before the first step: the resume itself goes ahead
        p = resume(runs, run, *overrides, *base, "train.steps=2")
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        return
    p = resume(runs, run, *overrides, *base)
    paragraph(p, "train", str(runs / run / "checkpoints" / "2"), *words)
    assert {p: p.stat().st_mtime_ns for p in (runs / run / "checkpoints").rglob("*")} == before


def test_dropout_may_change_on_resume_with_a_note(runs, capsys):
    shutil.copytree(runs / "lora", runs / "lora-dropout")
    cfg = load_config(overrides=[*RUN, *LORA, "model.lora.dropout=0.1", "train.steps=3",
                                 f"train.run_dir={runs / 'lora-dropout'}", f"checkpoint.load={runs / 'base'}"])
    result = train(cfg, jax.devices()[:1])
    assert len(result.losses) == 1 and np.isfinite(result.losses).all()
    assert "model.lora.dropout 0.0 -> 0.1: the adapters' inputs are dropped at the new rate from step 3 (the " \
           "parameters are the same)" in capsys.readouterr().out


def test_loading_a_lora_checkpoint_is_refused_with_the_ways_on(runs, tmp_path):
    p = megajax("train", *RUN, "train.steps=1", f"train.run_dir={tmp_path / 'new'}",
                f"checkpoint.load={runs / 'lora'}")
    paragraph(p, "train", "holds LoRA adapters, not a whole model", "resume their run", "--merge-lora",
              f"({runs / 'base' / 'checkpoints' / '2'})")
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------------------------
# the exact-match score of a LoRA run

def test_exact_match_of_a_lora_run_is_the_merged_models(tmp_path, monkeypatch):
    """recipes/sft-tiny-cpu with model.lora.rank=8 on a saved base scores its held-out prompts before and
    after (it crashed in the generator before step 1); the answers after are those of the run's merged
    Hugging Face export, generated and scored the same way."""
    from megajax.cli import run_training
    from megajax.data.chat import chat_template_of
    from megajax.inference import exact_match as em
    from megajax.inference.load import find_source, generation_config, load_model
    recipe = load_config(["recipes/sft-tiny-cpu"], ["train.precision=fp32", "model.vocab_size=257"])
    spec, _ = build_model_spec(recipe, recipe.model.padded_vocab_size())
    base = write_params_checkpoint(unflatten(random_weights(spec, 0.05, np.random.default_rng(0))), recipe,
                                   tmp_path / "base")
    answers = []
    scored = em.exact_match

    def recorded(generator, tokenizer, template, items, max_new_tokens, batch_size=32, **kw):
        accuracy, said = scored(generator, tokenizer, template, items, max_new_tokens, batch_size, **kw)
        answers.append((accuracy, said, items, max_new_tokens))
        return accuracy, said
    monkeypatch.setattr(em, "exact_match", recorded)
    cfg = train_config(["recipes/sft-tiny-cpu"], ["model.lora.rank=8", "model.lora.alpha=16", "train.steps=4",
                                                  "train.exact_match_prompts=8", "train.precision=fp32",
                                                  "optim.lr=2e-2", "optim.warmup_steps=1", "logging.progress=false",
                                                  "mesh.data=1", f"checkpoint.load={base}",
                                                  f"train.run_dir={tmp_path / 'run'}"])
    result = run_training(cfg, devices=jax.devices()[:1])
    assert set(result.exact_match) == {"before", "after"} and len(answers) == 2
    accuracy, after, items, longest = answers[1]
    assert len(after) == 8 and result.exact_match["after"] == accuracy

    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(tmp_path / "run"), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    source = find_source(None, str(tmp_path / "merged"))
    merged = load_model(generation_config(source, ["train.precision=fp32"]), source, devices=jax.devices()[:1])
    want_accuracy, want = scored(merged.generator, merged.tokenizer, chat_template_of(merged.tokenizer), items,
                                 longest)
    assert after == want and accuracy == want_accuracy
    assert answers[0][1] != after  # four steps of adapters changed the answers: the merge is not a no-op


# ----------------------------------------------------------------------------------------------
# an adapter trained from a Hugging Face directory, through PEFT and back

def _hf_llama(out, seed):
    import torch
    import transformers
    from megajax.data.tokenizer import ByteTokenizer, save_hf_tokenizer
    torch.manual_seed(seed)
    c = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.05)
    transformers.LlamaForCausalLM(c).save_pretrained(out)
    save_hf_tokenizer(ByteTokenizer(), out, max_length=64)
    return out


def test_peft_round_trip_of_an_adapter_trained_on_a_hugging_face_directory(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = _hf_llama(tmp_path / "hf", 0)
    own = [o for o in RUN if not o.startswith("model.")]  # the model comes from the directory
    cfg = train_config(overrides=[*own, *LORA, "train.steps=3", f"checkpoint.load={hf}",
                                  f"train.run_dir={tmp_path / 'run'}"])
    train(cfg, jax.devices()[:1])
    run = tmp_path / "run"
    assert main(["export", "--format", "peft", "--checkpoint", str(run), "--output", str(tmp_path / "peft"),
                 "--dtype", "fp32"]) == 0
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(hf.absolute())
    assert main(["import", "--format", "peft", "--input", str(tmp_path / "peft"), "--output",
                 str(tmp_path / "back")]) == 0  # the base from base_model_name_or_path
    assert main(["import", "--format", "peft", "--input", str(tmp_path / "peft"), "--base", str(hf), "--output",
                 str(tmp_path / "back2")]) == 0

    trained = CheckpointSource(run)
    for back in ("back", "back2"):
        got = CheckpointSource(tmp_path / back)
        (a, b), t = (got.model.lora, trained.model.lora), sorted
        assert (a.rank, a.alpha, t(a.targets)) == (b.rank, b.alpha, t(b.targets)) and t(got.names()) == t(trained.names())
        for name in trained.names():
            np.testing.assert_array_equal(got.get(name), trained.get(name), err_msg=name)

    def generate(*model):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.json"
        assert main(["generate", *model, "--prompt", "hello", "--prompt", "LoRA", "--max-new-tokens", "8",
                     "--json", str(out), "train.precision=fp32"]) == 0
        return [r["completion_ids"] for r in json.loads(out.read_text())]
    want = generate("--checkpoint", str(run))
    assert generate("--checkpoint", str(tmp_path / "back")) == want
    assert generate("--checkpoint", str(tmp_path / "back2")) == want
    assert generate("--hf", str(hf), "--adapter", str(tmp_path / "peft")) == want
    assert generate("--hf", str(hf)) != want  # the adapters change the completions

    # transformers and peft: the adapter on the directory computes the run's merged model
    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(run), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    toks = torch.from_numpy(np.random.default_rng(1).integers(0, 257, (2, 16))).long()
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()(toks).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        np.testing.assert_allclose(adapted.numpy()[..., :257], merged.eval()(toks).logits.numpy()[..., :257],
                                   atol=1e-4, rtol=1e-4)

    # the directory saved over with another model: every reader of the adapters refuses
    shutil.rmtree(hf)
    _hf_llama(hf, 1)
    changed = "has changed since the adapters were trained"
    paragraph(megajax("generate", "--checkpoint", str(run), "--prompt", "hi"), "generate", str(hf), changed)
    paragraph(megajax("export", "--format", "peft", "--checkpoint", str(run), "--output", str(tmp_path / "p2")),
              "export", changed)
    paragraph(megajax("train", *own, *LORA, "train.steps=4", f"checkpoint.load={hf}", f"train.run_dir={run}"),
              "train", changed)
    assert not (tmp_path / "p2").exists()


@pytest.mark.parametrize("options", [
    dict(target_modules=["q_proj", "v_proj"]),  # PEFT's default for Llama: k gets zeros beside them
    dict(target_modules=["up_proj", "down_proj"], use_rslora=True, layers_to_transform=[1]),
    dict(target_modules=r"model\.layers\.\d+\.(self_attn\.o|mlp\.gate)_proj", lora_dropout=0.05,
         init_lora_weights="gaussian"),
    dict(target_modules="all-linear"),
], ids=["q-v", "rslora-one-layer", "regex", "all-linear"])
def test_an_adapter_trained_in_peft_imports_computing_peft_logits(tmp_path, options):
    """Adapters written by peft itself (each module its own A, some modules or layers left out, rsLoRA's
    scale) become megajax adapters computing peft's logits on the same base (fp32, 1e-4)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_lora_export import megajax_logits
    from random_model import VOCAB, random_model
    cfg, _, params = random_model("llama")
    base = write_params_checkpoint(params, cfg, tmp_path / "base")
    assert main(["export", "--format", "hf", "--checkpoint", str(base), "--output", str(tmp_path / "hf"),
                 "--dtype", "fp32"]) == 0
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **options))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B starts at zero: give the adapters something to do
    adapted.save_pretrained(tmp_path / "peft")
    assert main(["import", "--format", "peft", "--input", str(tmp_path / "peft"), "--base", str(base), "--output",
                 str(tmp_path / "back")]) == 0
    back = CheckpointSource(tmp_path / "back")
    spec, _ = build_model_spec(load_config(base={**cfg.to_dict(), "model": {**cfg.to_dict()["model"],
                                                                            "lora": vars(back.model.lora)}}),
                               cfg.model.padded_vocab_size())
    adapters = unflatten({name: back.get(name) for name in back.names()})
    toks = np.random.default_rng(1).integers(0, VOCAB, (2, 32)).astype(np.int32)
    want = megajax_logits(spec, adapters, toks, frozen=params)
    with torch.no_grad():
        got = adapted.eval()(torch.from_numpy(toks).long()).logits.numpy()[..., :VOCAB]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.abs(want - megajax_logits(random_model("llama")[1], params, toks)).max() > 0.05  # the adapters matter
