"""`checkpoint.load=<Hugging Face directory>`: a model saved by transformers' save_pretrained trains with no
import step. Its model config and tokenizer come from the directory, its weights are streamed onto the
mesh, and the first step's loss equals transformers' loss on the same batch (fp32), on one device and on
a sharded layout, with the same gradient norm on both."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megajax.checkpoint.stored_model import train_config  # noqa: E402
from megajax.data.loader import build_run_datasets  # noqa: E402
from megajax.data.tokenizer import ByteTokenizer, load_tokenizer, save_hf_tokenizer  # noqa: E402
from megajax.errors import CheckpointError  # noqa: E402
from megajax.train.loop import train  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 300  # >= the byte tokenizer's 257 ids; padded to 384 inside megajax
# The run's own keys only: every model.* key comes from the directory.
RUN = ["train.seq_len=32", "train.global_batch=8", "train.log_every=1", "train.sample_tokens=0",
       "logging.tensorboard=false", "logging.progress=false", "data.corpus_max_mb=0.5", "optim.warmup_steps=1",
       "optim.lr=3e-3", "train.eval_every=0", "train.steps=2", "train.precision=fp32"]
SHARDED = ["mesh.tensor=2", "mesh.fsdp=2", "mesh.data=2"]


def _save(model, out, **options):
    with torch.no_grad():  # norm scales away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out, **options)
    save_hf_tokenizer(ByteTokenizer(), out, max_length=64)  # tokenizer.json: read back as data.tokenizer=byte
    return out


def _llama(out):
    torch.manual_seed(0)
    c = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.05)
    model = transformers.LlamaForCausalLM(c).eval()
    return model, _save(model, out)


def _hf_loss(model, cfg) -> float:
    """transformers' mean next-token loss on the run's first batch (samples 0..global_batch-1)."""
    dataset, _, _ = build_run_datasets(cfg, load_tokenizer(cfg.data.tokenizer))
    samples = np.stack([np.asarray(dataset[i]["tokens"] if isinstance(dataset[i], dict) else dataset[i])
                        for i in range(cfg.train.global_batch)])
    with torch.no_grad():
        logits = model(torch.from_numpy(samples[:, :-1]).long()).logits.double()
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.from_numpy(samples[:, 1:]).long().reshape(-1)))


def _check(model, hf_dir, tmp_path, layouts):
    runs = []
    for k, (mesh, devices) in enumerate(layouts):
        cfg = train_config(overrides=RUN + mesh + [f"checkpoint.load={hf_dir}", f"train.run_dir={tmp_path / f'run{k}'}"])
        assert cfg.data.tokenizer == "byte" and cfg.model.vocab_size == VOCAB
        result = train(cfg, devices=devices)
        assert len(result.losses) == 2 and np.isfinite(result.losses).all()
        runs.append(result)
    hf_loss = _hf_loss(model, cfg)
    assert hf_loss > 4.0  # a random model: ~log(300) = 5.7, not a trivially small loss
    for result in runs:
        np.testing.assert_allclose(result.losses[0], hf_loss, rtol=1e-5)
        np.testing.assert_allclose(result.grad_norms[0], runs[0].grad_norms[0], rtol=1e-5)
    return runs


def test_llama_directory_trains_on_one_device_and_sharded(tmp_path):
    model, hf_dir = _llama(tmp_path / "hf")
    _check(model, hf_dir, tmp_path, [([], jax.devices()[:1]), (SHARDED, None)])


def test_sharded_safetensors_and_qwen3_moe(tmp_path):
    """A Qwen3 MoE directory written in several safetensors shards (an index), experts over mesh.expert."""
    torch.manual_seed(1)
    c = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, norm_topk_prob=True,
        output_router_logits=False)
    model = transformers.Qwen3MoeForCausalLM(c).eval()
    hf_dir = tmp_path / "hf"
    _save(model, hf_dir, max_shard_size="100KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    _check(model, hf_dir, tmp_path, [(["mesh.expert=2", "mesh.tensor=2", "mesh.data=2"], None)])


def test_contradicting_model_key_is_one_error(tmp_path):
    _, hf_dir = _llama(tmp_path / "hf")
    with pytest.raises(CheckpointError) as e:
        train_config(overrides=RUN + [f"checkpoint.load={hf_dir}", "model.hidden_size=128"])
    assert "model.hidden_size=128" in str(e.value) and "model.hidden_size=64" in str(e.value)
    assert "config.json" in str(e.value)


def test_streamed_blocks_equal_the_host_import_on_any_sharding(tmp_path):
    """Every parameter streamed block by block, with its layer, expert or model dims split over the
    devices, equals import_hf's whole host copy (Mixtral: per-expert tensors, a pipeline-like layer split)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from flax import traverse_util
    from megajax.checkpoint.hf import import_hf, open_hf
    from megajax.checkpoint.hf_stream import stream_hf
    torch.manual_seed(2)
    c = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    hf_dir = tmp_path / "hf"
    transformers.MixtralForCausalLM(c).save_pretrained(hf_dir)
    _, host = import_hf(hf_dir)
    host = traverse_util.flatten_dict(host, sep="/")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))
    specs = {2: P("a", "b"), 3: P("a", "b", "c"), 4: P("a", "b", None, "c")}
    like = {p: jax.ShapeDtypeStruct(x.shape, np.float32, sharding=NamedSharding(mesh, specs.get(x.ndim, P())))
            for p, x in host.items()}
    with open_hf(hf_dir) as hf:
        streamed = stream_hf(hf, like)
    assert set(streamed) == set(host)
    for p, x in host.items():
        assert streamed[p].sharding == like[p].sharding
        np.testing.assert_array_equal(np.asarray(streamed[p]), x, err_msg=p)


def test_lora_on_a_hugging_face_directory(tmp_path):
    """model.lora with checkpoint.load=<Hugging Face directory>: the directory's weights become the frozen
    base (B starts at zero, so step 1's loss is transformers'), only the adapters train, and a resume of
    the adapter checkpoint reads the base back from the directory."""
    model, hf_dir = _llama(tmp_path / "hf")
    lora = ["model.lora.rank=4", "model.lora.targets=[qkv,fc2]", "checkpoint.every=2", "checkpoint.async_save=false"]
    cfg = train_config(overrides=RUN + SHARDED + lora + [f"checkpoint.load={hf_dir}",
                                                        f"train.run_dir={tmp_path / 'run'}"])
    first = train(cfg)
    np.testing.assert_allclose(first.losses[0], _hf_loss(model, cfg), rtol=1e-5)
    assert first.losses[1] != first.losses[0]
    longer = train_config(overrides=RUN + SHARDED + lora + [f"checkpoint.load={hf_dir}", "train.steps=3",
                                                           f"train.run_dir={tmp_path / 'run'}"])
    resumed = train(longer)
    assert len(resumed.losses) == 1 and np.isfinite(resumed.losses).all()

    # The adapters on the directory as their base: a PEFT adapter for it and the merged model, which
    # transformers and peft read to the same logits; a LoRA checkpoint alone generates on that base.
    from megajax.cli import main
    peft = pytest.importorskip("peft")
    run = tmp_path / "run"
    assert main(["export", "--format", "peft", "--checkpoint", str(run), "--output", str(tmp_path / "peft"),
                 "--dtype", "fp32"]) == 0
    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(run), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        base = model(ids).logits
        adapted = peft.PeftModel.from_pretrained(model, str(tmp_path / "peft")).eval()(ids).logits
        merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
    np.testing.assert_allclose(adapted.numpy(), merged.numpy(), atol=1e-4)
    assert float((merged - base).abs().max()) > 1e-3  # the adapters moved the model
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ab", "--max-new-tokens", "4"]) == 0
