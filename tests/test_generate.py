"""Cached generation: equal to full forward passes, to transformers' generate, and across layouts."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from random_model import VOCAB, random_model  # noqa: E402
from megajax.checkpoint.manager import write_params_checkpoint  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.inference.generate import Generator  # noqa: E402
from megajax.inference.load import Source, find_source, generation_config, load_model  # noqa: E402
from megajax.inference.sampling import Sampling  # noqa: E402

CONTEXT = 48
PROMPTS = ([65], [104, 101, 108, 108, 111, 33], list(range(70, 83)))  # ragged: 1, 6 and 13 tokens


def model(family="llama"):
    """(config, spec, params): the shared small random model (tests/random_model.py; GQA for llama) with
    weights large enough for clear argmax margins (N(0, 0.08)) and a CONTEXT-token window. Cached: do not
    mutate."""
    return random_model(family, std=0.08, seq_len=CONTEXT)


def full_forward_greedy(spec, params, prompt, n):
    """Reference: the whole window through the model for every new token. Returns (tokens, smallest
    margin between the best and second-best logit)."""
    apply = jax.jit(spec.apply)
    ids, margin = list(prompt), np.inf
    for _ in range(n):
        buf = np.zeros((1, CONTEXT), np.int32)
        buf[0, :len(ids)] = ids
        logits = np.asarray(apply(params, buf))[0, len(ids) - 1, :VOCAB]
        top2 = np.sort(logits)[-2:]
        margin = min(margin, top2[1] - top2[0])
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):], margin


@pytest.mark.parametrize("family,layer_buffers", [("llama", True), ("gpt", True), ("llama", False)])
def test_cached_greedy_equals_full_forward_on_a_ragged_batch(family, layer_buffers):
    cfg, spec, params = model(family)
    gen = Generator(cfg.model, params, eod_id=None, layer_buffers=layer_buffers)
    done, timing = gen.generate(PROMPTS, Sampling(), 12)
    for prompt, c in zip(PROMPTS, done):
        want, margin = full_forward_greedy(spec, params, prompt, 12)
        assert margin > 1e-4  # the reference's choices are not ties
        assert c.completion_ids == want and c.finish_reason == "length"
        assert c.prompt_ids == list(prompt)
    assert timing.decode_tokens == 3 * 11 and timing.time_to_first_token_s > 0


def test_each_sequence_stops_at_end_of_document_and_budget():
    cfg, spec, params = model("llama")
    want = [full_forward_greedy(spec, params, p, 10)[0] for p in PROMPTS]
    eod = want[1][3]  # the second prompt's 4th new token plays end-of-document
    assert eod not in want[1][:3]
    gen = Generator(cfg.model, params, eod_id=eod)
    done, _ = gen.generate(PROMPTS, Sampling(), [10, 10, 5])
    assert done[1].completion_ids == want[1][:4] and done[1].finish_reason == "stop"
    for c, w, n in ((done[0], want[0], 10), (done[2], want[2], 5)):
        expect = w[:w.index(eod) + 1] if eod in w[:n] else w[:n]
        assert c.completion_ids == expect
        assert c.finish_reason == ("stop" if eod in w[:n] else "length")


def test_prompt_over_the_context_is_refused_naming_the_limit():
    cfg, _, params = model("gpt")
    gen = Generator(cfg.model, params)
    with pytest.raises(Exception, match=f"context length is {CONTEXT} tokens.*40 tokens and asks for 9"):
        gen.generate([[1] * 40], Sampling(), 9)
    with pytest.raises(Exception, match="at most 1 new token[.]"):
        gen.check([[1] * (CONTEXT - 1)], [3])
    with pytest.raises(Exception, match=f"{CONTEXT} tokens, which leaves no room for a new token"):
        gen.check([[1] * CONTEXT], [1])
    gen.check([[1] * CONTEXT], [0])  # a budget of 0 scores the prompt: it only has to fit


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy():
    cfg, _, params = model("llama")
    gen = Generator(cfg.model, params, eod_id=None)
    hot = [Sampling(temperature=1.5, top_p=0.95, seed=s) for s in (7, 7, 8)]
    a, _ = gen.generate([PROMPTS[1]] * 3, hot, 16)
    b, _ = gen.generate([PROMPTS[2], PROMPTS[1], PROMPTS[1]], [Sampling(), *hot[1:]], 16)
    assert a[0].completion_ids == a[1].completion_ids == b[1].completion_ids  # same seed, any batch position
    assert a[2].completion_ids != a[1].completion_ids  # another seed
    greedy, _ = gen.generate(PROMPTS, Sampling(), 16)
    top1, _ = gen.generate(PROMPTS, Sampling(temperature=2.0, top_k=1, seed=3), 16)
    assert [c.completion_ids for c in top1] == [c.completion_ids for c in greedy]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A megajax checkpoint of the llama model, saved with mesh.tensor=4 (its layout for generation)."""
    cfg, _, params = model("llama")
    cfg = load_config(base=cfg.to_dict(), overrides=["mesh.tensor=4"])
    out = tmp_path_factory.mktemp("ckpt") / "run"
    write_params_checkpoint(params, cfg, out)
    return out


def _load(path, *overrides, devices=None):
    source = find_source(str(path), None)
    return load_model(generation_config(source, list(overrides)), source, devices=devices,
                      user_mesh=any(o.startswith("mesh.") for o in overrides))


def test_generation_on_data_2_tensor_4_equals_one_device(checkpoint):
    one = _load(checkpoint, devices=jax.devices()[:1])
    assert one.mesh_text == "1 device" and one.notes  # the saved tensor=4 does not fit one device: said so
    sharded = _load(checkpoint, "mesh.data=2", "mesh.tensor=4")
    assert sharded.mesh_text == "data=2 x tensor=4"
    default = _load(checkpoint)
    assert default.mesh_text == "data=2 x tensor=4"  # the checkpoint's tensor=4, data takes the rest
    samplings = [Sampling(), Sampling(temperature=1.0, top_k=20, seed=1), Sampling(temperature=0.7, seed=2)]
    want, _ = one.generator.generate(PROMPTS, samplings, 12)
    got, _ = sharded.generator.generate(PROMPTS, samplings, 12)
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
    state = sharded.generator.start(PROMPTS, samplings, [4] * 3)
    assert len(state.cache_k) == 2  # one [batch, kv_heads, slots, head_dim] buffer per layer
    for cache in state.cache_k + state.cache_v:
        assert cache.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp", "expert"), "tensor", None, None)
        assert cache.shape[0] == 4  # the batch bucket: 2 rows per data rank


def test_greedy_equals_transformers_generate_on_the_hf_export(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from megajax.checkpoint.hf import export_hf
    from megajax.checkpoint.source import DictSource
    for family in ("llama", "gpt"):
        cfg, _, params = model(family)
        out = tmp_path / family
        export_hf(DictSource(params, cfg.model), out, tokenizer_spec="byte", dtype="fp32")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        loaded = _load_hf(out)
        done, _ = loaded.generator.generate(PROMPTS, Sampling(), 10)
        for prompt, c in zip(PROMPTS, done):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                   pad_token_id=0)[0, len(prompt):].tolist()
            assert c.completion_ids == want, family


def _load_hf(path):
    source = find_source(None, str(path))
    return load_model(generation_config(source, []), source)


def test_generate_command_writes_json_and_matches_the_generator(checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps("A") + "\n")
    out = tmp_path / "out.json"
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompts-file", str(prompts), "--max-new-tokens",
                 "6", "--json", str(out), "mesh.data=8", "mesh.tensor=1"]) == 0
    printed = capsys.readouterr()
    results = json.loads(out.read_text())
    assert [r["prompt"] for r in results] == ["hello", "A"]
    cfg, spec, params = model("llama")
    for r in results:
        assert r["prompt_ids"] == list(r["prompt"].encode())
        assert r["completion_ids"] == full_forward_greedy(spec, params, r["prompt_ids"], 6)[0]
        assert r["text"] == bytes(t for t in r["completion_ids"] if t < 256).decode("utf-8", "replace")
        assert r["time_to_first_token_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["prompt"] + r["text"] in printed.out
    assert "time to first token" in printed.err


@pytest.mark.parametrize("args,message", [
    (["--prompt", "x" * 45, "--max-new-tokens", "9"], "context length is 48 tokens"),
    (["--prompt", "x", "--top-k", "5"], "--temperature"),
    ([], "--prompt TEXT"),
    (["--prompt", "x", "--top-p", "1.5", "--temperature", "1"], "--top-p=1.5"),
])
def test_generate_command_user_errors(checkpoint, capsys, args, message):
    assert main(["generate", "--checkpoint", str(checkpoint), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_command_needs_a_model(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    assert "no megajax checkpoint there" in capsys.readouterr().err
    assert main(["generate", "--hf", str(tmp_path), "--prompt", "x"]) == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err


def test_source_is_one_of_checkpoint_or_hf(checkpoint):
    with pytest.raises(Exception, match="one of them"):
        find_source(str(checkpoint), str(checkpoint))
    assert isinstance(find_source(str(checkpoint), None), Source)


def test_end_of_training_sample_is_what_generate_prints(small_config, tmp_path, capsys):
    from megajax.cli import run_training  # the train command's loop, with its end-of-training sample
    cfg = small_config("train.sample_tokens=10", "train.seed=3", "train.eval_every=2", steps=2)
    result = run_training(cfg)
    out = tmp_path / "out.json"
    prompt = result.sample_prompt  # a held-out document's first lines (train.sample_prompt is "")
    assert prompt and prompt.endswith("\n") and not cfg.train.sample_prompt
    assert main(["generate", "--checkpoint", cfg.train.run_dir, "--prompt", prompt, "--max-new-tokens", "10",
                 "--temperature", "0.8", "--top-p", "0.95", "--seed", "3", "--json", str(out)]) == 0
    completion = json.loads(out.read_text())[0]["text"]
    assert result.sample == prompt + completion
    assert len(set(completion)) > 1  # drawn, not one token repeated (greedy from 2 steps repeats one)
    assert "megajax generate: 1 prompt on" in capsys.readouterr().err


# Qwen3-MoE-style: q/k norms (their scales drawn around 1 like every norm), head_dim 16 (not hidden /
# heads = 8), layer 0 MoE with pre-softmax routing, layer 1 dense.
QWEN3_MOE = ("model.qk_norm=true", "model.head_dim=16", "model.num_experts=4", "model.moe_router_topk=2",
             "model.moe_ffn_hidden_size=32", "model.moe_layer_freq=2", "model.moe_router_pre_softmax=true")


def test_qwen3_moe_cached_greedy_equals_full_forward_and_transformers(tmp_path):
    """The KV-cache path normalises q and k like the full forward (cached greedy = uncached), and the
    Hugging Face export (Qwen3MoeForCausalLM) generates the same tokens in transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from megajax.checkpoint.hf import export_hf
    from megajax.checkpoint.source import DictSource
    cfg, spec, params = random_model("llama", *QWEN3_MOE, std=0.08, seq_len=CONTEXT)
    done, _ = Generator(cfg.model, params, eod_id=None).generate(PROMPTS, Sampling(), 10)
    out = tmp_path / "hf"
    export_hf(DictSource(params, cfg.model), out, tokenizer_spec="byte", dtype="fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    for prompt, c in zip(PROMPTS, done):
        want, margin = full_forward_greedy(spec, params, prompt, 10)
        assert margin > 1e-4 and c.completion_ids == want
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf_ids = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert c.completion_ids == hf_ids


def test_held_out_prompt_is_a_documents_first_whole_lines():
    """The sample's prompt: whole lines of a held-out document, starting at an unindented line (a sample's
    first line is cut), at most PROMPT_LINES within PROMPT_CHARS; None when no sample has one."""
    from megajax.data.tokenizer import ByteTokenizer
    from megajax.inference.text import PROMPT_LINES, held_out_prompt
    tok = ByteTokenizer()
    doc = "import os\ndef f(x):\n    return x\nclass A:\n    pass\n"
    ids = tok.encode("t_cut_line\n    indented\n") + [tok.eod_id] + tok.encode(doc) + [tok.eod_id]
    got = held_out_prompt(tok, [{"tokens": ids}])
    assert got == "\n".join(doc.split("\n")[:PROMPT_LINES]) + "\n"
    # a document that starts mid-way: the cut first line and the indented ones are skipped
    assert held_out_prompt(tok, [tok.encode("x = 1\n    y\nz = 2\nw\n")]) == "z = 2\nw\n"
    assert held_out_prompt(tok, [tok.encode("x = 1\n    y\nz = 2\nw\n")], max_tokens=7) == "z = 2\n"
    assert held_out_prompt(tok, [tok.encode("no newline at all")]) is None
