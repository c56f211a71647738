"""Megatron-LM's names in megajax (megajax/megatron_args.py): config errors that name the megajax key,
Megatron flags typed on the megajax command line, and `megajax config from-megatron`, against the
shipped presets and recipes. Nothing here compiles; the plans are built without devices."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_docs import KEYS  # every dotted config key

from megajax import megatron_args as ma
from megajax.config import Config, load_config
from megajax.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

# The flags of Megatron-LM's example launch scripts (examples/gpt3/train_gpt3_175b_distributed.sh,
# examples/llama/train_llama3_8b_h100_fp8.sh, examples/mixtral/train_mixtral_8x7b_distributed.sh):
# each has a row in the table, mapped or saying why not.
EXAMPLE_FLAGS = {
    "gpt3-175b": """--num-layers --hidden-size --num-attention-heads --seq-length --max-position-embeddings
        --attention-backend --micro-batch-size --global-batch-size --rampup-batch-size --train-iters --weight-decay
        --adam-beta1 --adam-beta2 --init-method-std --clip-grad --fp16 --lr --lr-decay-style --min-lr
        --lr-warmup-fraction --lr-decay-iters --tensor-model-parallel-size --pipeline-model-parallel-size
        --data-path --vocab-file --merge-file --split --log-interval --save-interval --eval-interval --save --load
        --eval-iters --tensorboard-dir""",
    "llama3-8b": """--use-mcore-models --num-layers --hidden-size --ffn-hidden-size --num-attention-heads
        --group-query-attention --num-query-groups --kv-channels --seq-length --max-position-embeddings
        --position-embedding-type --rotary-base --rotary-percent --attention-dropout --hidden-dropout --swiglu
        --init-method-std --attention-backend --apply-layernorm-1p --untie-embeddings-and-output-weights
        --disable-bias-linear --micro-batch-size --global-batch-size --train-samples --lr-decay-samples
        --lr-warmup-samples --lr --min-lr --decoupled-lr --decoupled-min-lr --lr-decay-style --clip-grad
        --weight-decay --adam-beta1 --adam-beta2 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
        --calculate-per-token-loss --manual-gc --empty-unused-memory-level --exit-duration-in-mins --fp8-format
        --fp8-amax-history-len --fp8-amax-compute-algo --fp8-param-gather --tensor-model-parallel-size
        --context-parallel-size --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce
        --overlap-param-gather --mock-data --tokenizer-type --vocab-size --data-cache-path --tiktoken-pattern
        --split --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers --data-path
        --tokenizer-model --log-interval --eval-iters --eval-interval --save-interval --log-throughput --profile
        --profile-step-start --profile-step-end --ckpt-format --distributed-timeout-minutes --save --load
        --tensorboard-dir""",
    "mixtral-8x7b": """--use-mcore-models --disable-bias-linear --seq-length --max-position-embeddings --num-layers
        --hidden-size --ffn-hidden-size --num-attention-heads --init-method-std --attention-dropout
        --hidden-dropout --normalization --position-embedding-type --swiglu --untie-embeddings-and-output-weights
        --group-query-attention --num-query-groups --no-masked-softmax-fusion --no-position-embedding
        --rotary-base --num-experts --moe-router-topk --moe-router-load-balancing-type --moe-aux-loss-coeff
        --moe-grouped-gemm --moe-token-dispatcher-type --overlap-param-gather --overlap-grad-reduce
        --tokenizer-type --tokenizer-model --data-path --split --micro-batch-size --global-batch-size --lr
        --train-iters --lr-decay-iters --lr-decay-style --min-lr --weight-decay --lr-warmup-iters --clip-grad
        --bf16 --tensor-model-parallel-size --pipeline-model-parallel-size --expert-model-parallel-size
        --use-distributed-optimizer --sequence-parallel --log-interval --save-interval --eval-interval
        --eval-iters --save --load --tensorboard-dir --no-load-optim --no-load-rng --wandb-project
        --wandb-exp-name""",
}

# Launch lines as the examples write them, shell variables at the scripts' own values (or left as
# placeholders where the script takes them from its command line).
LLAMA3_8B = """--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
    --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
    --untie-embeddings-and-output-weights --disable-bias-linear
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
    --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
    --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235
    --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --data-path $DATA_ARG --tokenizer-type HuggingFaceTokenizer --tokenizer-model $TOKENIZER_ARG
    --data-cache-path $DATA_CACHE_PATH --split '99,1,0' --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files --num-workers 1 --vocab-size 128256
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
    --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
    --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --tensorboard-dir $TENSORBOARD_LOGS_PATH"""

MIXTRAL_8X7B = """--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
    --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
    --no-position-embedding --rotary-base 1000000
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
    --tokenizer-type Llama2Tokenizer --tokenizer-model $TOKENIZER_MODEL --data-path $DATA_PATH --split 99990,8,2
    --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
    --use-distributed-optimizer --sequence-parallel
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH --tensorboard-dir $CHECKPOINT_PATH/tensorboard --no-load-optim --no-load-rng"""


def words(line: str) -> list[str]:
    return shlex.split(line)


def config_of(line: str, *extra: str) -> Config:
    """The translated line through megajax's own config loading (as `megajax train --config FILE` reads it)."""
    return load_config(base=ma.translate(words(line) + list(extra)).tree())


def without(line: str, *flags: str) -> str:
    """The launch line less these flags and their values."""
    out, skipping = [], False
    for w in words(line):
        if w.startswith("--"):
            skipping = w in flags
        if not skipping:
            out.append(w)
    return shlex.join(out)


def model_fields(cfg: Config) -> dict:
    return dataclasses.asdict(cfg.model)


def differing(a: Config, b: Config) -> set[str]:
    x, y = model_fields(a), model_fields(b)
    return {k for k in x if x[k] != y[k]}


def megajax(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "megajax.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


# ----------------------------------------------------------------------------------------------
# The table

def test_every_row_names_a_real_key_and_every_unmapped_row_says_why():
    keys = set(KEYS)
    assert len(ma.FLAGS) > 150
    assert len(ma.BY_NAME) == len(ma.FLAGS), "one row per flag"
    for f in ma.FLAGS:
        assert f.flag.startswith("--") and f.flag == f.flag.lower() and " " not in f.flag, f.flag
        assert f.key is None or f.key in keys, f"{f.flag}: {f.key} is not a megajax config key"
        assert f.key is not None or f.note, f"{f.flag}: a flag with no megajax key needs a note saying why"


@pytest.mark.parametrize("script", sorted(EXAMPLE_FLAGS))
def test_every_flag_of_megatrons_example_scripts_has_a_row(script):
    missing = [flag for flag in EXAMPLE_FLAGS[script].split() if ma.lookup(flag) is None]
    assert not missing, f"flags of Megatron-LM's {script} example without a row in megajax/megatron_args.py"


def test_the_docs_hold_the_table():
    doc = (ROOT / "docs" / "megatron-users.md").read_text()
    table = ma.markdown_table()
    assert table in doc, ("docs/megatron-users.md's flag table differs from megajax/megatron_args.py; paste the "
                          "output of: python -c 'from megajax.megatron_args import markdown_table as t; print(t())'")


# ----------------------------------------------------------------------------------------------
# Config errors and command-line flags

@pytest.mark.parametrize("override, expected", [
    ("train.train_iters=5", "Megatron's --train-iters is train.steps"),
    ("train_iters=5", "Megatron's --train-iters is train.steps"),
    ("num_layers=4", "Megatron's --num-layers is model.num_layers"),
    ("mesh.tensor_model_parallel_size=2", "Megatron's --tensor-model-parallel-size is mesh.tensor"),
    ("train.bf16=true", "Megatron's --bf16 is train.precision=bf16"),
    ("model.num-attention-heads=8", "Megatron's --num-attention-heads is model.num_heads"),
    ("model.apply_layernorm_1p=true", "Megatron's --apply-layernorm-1p has no megajax key"),
])
def test_unknown_key_that_is_a_megatron_name_names_the_megajax_key(override, expected):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("+", r"\+")):
        load_config(overrides=[override])


def test_other_unknown_keys_keep_their_hints():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["model.num_hedas=4"])
    assert "did you mean model.num_heads?" in str(e.value) and "Megatron" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["train.zzz=4"])
    assert "did you mean" not in str(e.value) and "Megatron" not in str(e.value)


def test_megajax_train_with_megatron_flags(tmp_path):
    for args in (["--num-layers", "24"], ["--num-layers=24"]):
        p = megajax("train", *args, "train.steps=1", cwd=tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1, p.stderr  # one paragraph
        assert ("--num-layers is Megatron's flag; megajax spells it model.num_layers=24 (or: megajax config "
                "from-megatron -- ") in p.stderr, p.stderr
    p = megajax("train", "train.train_iters=5", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "config key train.train_iters: unknown key; Megatron's --train-iters is train.steps." in p.stderr
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_spell_converts_values():
    assert ma.spell("--normalization", "RMSNorm").endswith("model.norm=rmsnorm")
    assert ma.spell("--bf16", None).endswith("train.precision=bf16")
    assert ma.spell("--untie-embeddings-and-output-weights", None).endswith("model.tie_embeddings=false")
    assert "has no equivalent" in ma.spell("--apply-layernorm-1p", None)
    assert "needs nothing" in ma.spell("--use-mcore-models", None)


# ----------------------------------------------------------------------------------------------
# megajax config from-megatron

def test_from_megatron_prints_a_config_megajax_train_loads(tmp_path):
    p = megajax("config", "from-megatron", "--", *words(MIXTRAL_8X7B), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "not mapped" in p.stderr and "Traceback" not in p.stderr
    out = tmp_path / "mixtral.yaml"
    out.write_text(p.stdout)
    text = p.stdout
    assert "  num_kv_heads: 8  # --num-query-groups 8\n" in text
    assert "  run_dir: $CHECKPOINT_PATH  # --save $CHECKPOINT_PATH\n" in text  # a placeholder stays a string
    assert "#   --tokenizer-type Llama2Tokenizer: megajax reads a Hugging Face tokenizer.json" in text
    assert "#   --load $CHECKPOINT_PATH: the same directory as --save" in text
    data = yaml.safe_load(text)
    assert data["model"]["num_experts"] == 8 and data["mesh"] == {"tensor": 1, "pipeline": 4, "expert": 8}
    cfg = load_config([str(out)])  # what megajax train --config mixtral.yaml reads
    assert cfg.train.run_dir == "$CHECKPOINT_PATH" and cfg.data.path == "$DATA_PATH"
    # Every flag of the line is accounted for: a key's comment, or the lists of the header.
    for flag in {w for w in words(MIXTRAL_8X7B) if w.startswith("--")}:
        assert f"# {flag}" in text or f"#   {flag}" in text, flag


def test_from_megatron_refuses_what_megajax_refuses(tmp_path):
    p = megajax("config", "from-megatron", "--", "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "3", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "model.hidden_size=64" in p.stderr, p.stderr
    assert p.stdout == ""


def test_switches_lists_and_placeholders():
    t = ma.translate(words("""--num-layers $NUM_LAYERS --bf16 --swiglu --no-masked-softmax-fusion --data-path 0.3
        a_text_document 0.7 $DATA/b_text_document --save ckpt --load other --unknown-flag 3 --lr-warmup-fraction .001
        --train-iters 1000 --num-layers-per-virtual-pipeline-stage 2 --pipeline-model-parallel-size 2"""))
    got = {k: v for k, (v, _) in t.assignments.items()}
    assert got["data.path"] == [0.3, "a_text_document", 0.7, "$DATA/b_text_document"]
    assert got["train.precision"] == "bf16" and got["model.activation"] == "swiglu"
    assert got["train.run_dir"] == "ckpt" and got["checkpoint.load"] == "other"
    assert got["optim.warmup_steps"] == 1 and "model.num_layers" not in got
    assert "parallel.virtual_stages" not in got  # needs --num-layers, which is a placeholder here
    unmapped = dict(t.unmapped)
    assert "environment variable" in unmapped["--num-layers $NUM_LAYERS"]
    assert "--unknown-flag 3" in unmapped
    assert ("--no-masked-softmax-fusion", ma.XLA_FUSES) in t.needless
    t = ma.translate(words("--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2"))
    got = {k: v for k, (v, _) in t.assignments.items()}
    assert got["parallel.virtual_stages"] == 2 and got["parallel.pipeline_schedule"] == "interleaved"
    # Megatron's defaults where megajax's differ, and no grouped-query attention without its switch.
    t = ma.translate(words("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --fp16"))
    cfg = load_config(base=t.tree())
    m = cfg.model
    assert (m.family, m.norm, m.activation, m.position_embedding, m.use_bias, m.tie_embeddings) == (
        "gpt", "layernorm", "gelu_tanh", "learned", True, True)  # Megatron's fused bias-GELU: the tanh form
    assert (m.num_kv_heads, m.ffn_hidden_size, m.hidden_dropout) == (4, 256, 0.1)
    assert (cfg.optim.weight_decay, cfg.optim.beta2, cfg.optim.decay_style, cfg.optim.min_lr) == (
        0.01, 0.999, "linear", 0.0)
    # Flash attention with Megatron's default attention dropout: megajax's kernel has none, so the line runs
    # with the XLA attention (and says so); without dropout the kernel stays.
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --use-flash-attn"
    t = ma.translate(words(base))
    assert load_config(base=t.tree()).model.attention_impl == "xla"
    assert "--attention-dropout 0.0 to keep the kernel" in dict(t.unmapped)["--use-flash-attn"]
    assert load_config(base=ma.translate(words(base + " --attention-dropout 0.0")).tree()).model.attention_impl == "flash"


# ----------------------------------------------------------------------------------------------
# Megatron's example launch lines against the shipped presets and recipes

def test_llama3_8b_example_against_the_preset():
    """The model section of Megatron's Llama 3 8B example against configs/model/llama3-8b.yaml. The example
    differs from Llama 3 in four fields, which a Megatron user changes with four flags:
    - norm: it passes no --normalization, so Megatron's LayerNorm (with --apply-layernorm-1p, reported as
      not mapped); Llama 3 is RMSNorm;
    - rope_theta: it uses 1e6; Llama 3's is 5e5;
    - init_std: its initialisation scale (0.0134), a training choice; the preset keeps megajax's 0.02;
    - attention_impl: --attention-backend fused is cuDNN attention; the preset runs XLA's."""
    preset = load_config(["model/llama3-8b"])
    example = config_of(LLAMA3_8B)
    assert differing(example, preset) == {"norm", "rope_theta", "init_std", "attention_impl"}
    fixed = config_of(LLAMA3_8B, "--normalization", "RMSNorm", "--rotary-base", "500000",
                      "--init-method-std", "0.02", "--attention-backend", "auto")
    assert model_fields(fixed) == model_fields(preset)
    assert (fixed.train.seq_len, example.train.precision) == (preset.train.seq_len, "fp8")
    # Counts in samples became steps of the 128-sample global batch.
    assert (example.train.steps, example.optim.decay_steps, example.optim.warmup_steps) == (
        1953125000 // 128, 1949218748 // 128, 3906252 // 128)
    assert example.precision.fp8_amax_history_len == 1024 and example.ops.profile_steps == [4, 6]


def test_mixtral_8x7b_example_against_the_preset():
    """The model section of Megatron's Mixtral 8x7B example against configs/model/mixtral-8x7b.yaml. Two fields
    differ legitimately: vocab_size (the example takes it from its SentencePiece tokenizer, 32000, which
    megajax does not read: left to data.tokenizer) and init_std (the example's 0.01, a training choice)."""
    preset = load_config(["model/mixtral-8x7b"])
    example = config_of(MIXTRAL_8X7B)
    assert differing(example, preset) == {"vocab_size", "init_std"}
    fixed = config_of(MIXTRAL_8X7B, "--vocab-size", "32000", "--init-method-std", "0.02")
    assert model_fields(fixed) == model_fields(preset)


def plan(cfg: Config, devices: int):
    from megajax.plan import make_plan
    return make_plan(cfg, devices)


def test_recipe_layouts_from_megatron_flags():
    """A Megatron user's flags for each recipe's layout give the recipe's plan: the mesh (total size of each
    axis), the batch layout and the parallel settings. Compared on the plan because the recipe puts the
    pipeline across nodes (mesh.dcn.pipeline) where Megatron has one pipeline size; the optimizer and
    logging keys are not compared (the presets keep megajax's defaults, a translation Megatron's)."""
    # recipes/mixtral-8x7b-32xh100: expert 4 x tensor 2 x pipeline 4, sequence parallel, cuDNN attention.
    recipe = load_config(["recipes/mixtral-8x7b-32xh100"])
    layout = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --expert-model-parallel-size 4 "
              "--micro-batch-size 1 --global-batch-size 128 --train-iters 100000 --log-interval 10 "
              "--save-interval 500 --recompute-activations --attention-backend fused --vocab-size 32000 "
              "--init-method-std 0.02")
    line = without(MIXTRAL_8X7B, "--use-distributed-optimizer", "--tensor-model-parallel-size",
                   "--pipeline-model-parallel-size", "--expert-model-parallel-size", "--micro-batch-size",
                   "--global-batch-size", "--train-iters", "--log-interval", "--save-interval")
    cfg = config_of(line + " " + layout)
    a, b = plan(cfg, 32), plan(recipe, 32)
    assert a.sizes == b.sizes and a.batch == b.batch and a.pipeline == b.pipeline
    assert cfg.parallel == recipe.parallel and model_fields(cfg) == model_fields(recipe)
    assert (cfg.train.steps, cfg.train.log_every, cfg.checkpoint.every) == (
        recipe.train.steps, recipe.train.log_every, recipe.checkpoint.every)
    # recipes/llama3-8b-8xh100: FSDP over the node (Megatron's --use-torch-fsdp2), global batch 64 of 1.
    recipe = load_config(["recipes/llama3-8b-8xh100"])
    line = without(LLAMA3_8B, "--global-batch-size", "--use-distributed-optimizer", "--sequence-parallel",
                   "--train-samples", "--data-path", "--tokenizer-model", "--fp8-format")
    cfg = config_of(line, "--global-batch-size", "64", "--use-torch-fsdp2", "--recompute-activations",
                    "--normalization", "RMSNorm", "--rotary-base", "500000", "--init-method-std", "0.02",
                    "--attention-backend", "auto", "--train-iters", "10000", "--log-interval", "10")
    assert cfg.train.precision == recipe.train.precision == "bf16"  # without --fp8-format: the example's --bf16
    a, b = plan(cfg, 8), plan(recipe, 8)
    assert a.sizes == b.sizes and a.batch == b.batch and cfg.parallel == recipe.parallel
    assert model_fields(cfg) == model_fields(recipe)


# A pretrain_mamba.py line for configs/model/tiny-hybrid.yaml (Nemotron-H's flags at toy sizes).
TINY_HYBRID = """--num-layers 8 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --ffn-hidden-size 256 --squared-relu --position-embedding-type none --normalization RMSNorm
    --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
    --init-method-std 0.02 --is-hybrid-model --hybrid-override-pattern M*-EM*-E --mamba-state-dim 16
    --mamba-head-dim 16 --mamba-num-groups 2 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128
    --moe-shared-expert-intermediate-size 128 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 0.01 --seq-length 128 --max-position-embeddings 128"""


@pytest.mark.parametrize("pattern_flag", ["--hybrid-override-pattern", "--hybrid-layer-pattern"])
def test_hybrid_flags_against_the_preset(pattern_flag):
    """A hybrid's flags (the pattern by either name, the Mamba sizes, squared ReLU, no position embedding)
    give configs/model/tiny-hybrid.yaml's model. Two fields differ: the family (the preset's llama, gpt for
    Megatron's list without rotary positions: the same layers, as both name norm and activation) and the
    scan's chunk length (the preset's 32 for CPU runs; Megatron fixes its at 128, megajax's default)."""
    preset = load_config(["model/tiny-hybrid"])
    line = TINY_HYBRID.replace("--hybrid-override-pattern", pattern_flag)
    example = config_of(line)
    assert differing(example, preset) == {"family", "mamba_chunk_size"}
    assert example.model.hybrid_layer_pattern == "M*-EM*-E" and example.model.activation == "squared_relu"
    t = ma.translate(words(line + " --hybrid-attention-ratio 0.25"))
    assert [text for text, _ in t.unmapped] == ["--hybrid-attention-ratio 0.25"]
    assert "--is-hybrid-model" in [text for text, _ in t.needless]


def test_sft_flags_become_chat_data():
    """Megatron's --sft line (SFTDataset: jsonl messages through the tokenizer's chat template) is
    data.format=chat with the Hugging Face tokenizer; a named prompt format other than the tokenizer's
    own template is reported, not guessed."""
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --sft --tokenizer-type SFTTokenizer "
            "--tokenizer-model /models/qwen3 --sft-tokenizer-prompt-format default --data-path chat.jsonl "
            "--split 90,9,1")
    t = ma.translate(words(line))
    got = {k: v for k, (v, _) in t.assignments.items()}
    assert got["data.format"] == "chat" and got["data.tokenizer"] == "/models/qwen3"
    assert got["data.path"] == "chat.jsonl" and got["data.split"] == "90,9,1"
    needless = dict(t.needless)
    assert "--sft-tokenizer-prompt-format default" in needless and "--tokenizer-type SFTTokenizer" in needless
    cfg = load_config(base=t.tree())
    assert (cfg.data.format, cfg.data.loss_on, cfg.data.packing) == ("chat", "assistant", True)
    named = ma.translate(words(line.replace("format default", "format nemotron-h-aligned")))
    why = dict(named.unmapped)["--sft-tokenizer-prompt-format nemotron-h-aligned"]
    assert "chat_template" in why and "default" in why
    assert ma.spell("--sft", None).endswith("megajax spells it data.format=chat")
