"""A Hugging Face checkpoint written by transformers itself (`save_pretrained`, not megajax's exporter)
imports with `megajax import` and trains: the first step's loss on a parallel layout equals the loss
the transformers model computes on the same batch."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megajax.cli import main  # noqa: E402
from megajax.data.loader import build_run_datasets  # noqa: E402
from megajax.data.tokenizer import load_tokenizer  # noqa: E402
from megajax.train.loop import train  # noqa: E402

VOCAB = 300  # >= the byte tokenizer's 257 ids; padded to 384 inside megajax


def test_transformers_llama_imports_and_trains_a_step(small_config, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.05)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # norm scales away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")

    assert main(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mj")]) == 0
    capsys.readouterr()
    cfg = small_config(f"model.vocab_size={VOCAB}", "model.max_position_embeddings=64", "mesh.data=2",
                       "mesh.fsdp=2", "mesh.tensor=2", f"checkpoint.load={tmp_path / 'mj'}", steps=1)
    result = train(cfg)
    assert np.isfinite(result.losses[0])

    # The batch of step 1: samples 0..7 of the run's training dataset, tokens and next tokens.
    dataset, _, _ = build_run_datasets(cfg, load_tokenizer(cfg.data.tokenizer))
    samples = np.stack([np.asarray(dataset[i]["tokens"] if isinstance(dataset[i], dict) else dataset[i])
                        for i in range(cfg.train.global_batch)])
    tokens, labels = samples[:, :-1], samples[:, 1:]
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(labels).long().reshape(-1))
    np.testing.assert_allclose(result.losses[0], float(hf_loss), rtol=1e-5)
    assert result.losses[0] > 4.0  # a random model: ~log(300) = 5.7, not a trivially small loss
