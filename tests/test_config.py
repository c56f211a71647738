"""Config loading: shipped files, overrides, includes, and one clear message per mistake."""

import math

import jax
import pytest

from megajax.config import CONFIG_DIR, MESH_AXES, load_config, parse_override
from megajax.errors import ConfigError, MeshError
from megajax.mesh import make_mesh, mesh_sizes
from megajax.plan import make_plan
from megajax.train.state import build_model_spec

SHIPPED = sorted(CONFIG_DIR.rglob("*.yaml"))


def test_configs_are_shipped():
    names = {str(p.relative_to(CONFIG_DIR)) for p in SHIPPED}
    for want in ["model/tiny.yaml", "model/gpt2-125m.yaml", "model/megatron-gpt-1.3b.yaml",
                 "model/llama3-8b.yaml", "model/llama3-70b.yaml", "mesh/cpu-8.yaml", "mesh/gpu-1.yaml",
                 "mesh/gpu-8.yaml", "mesh/4x8-gpu.yaml", "mesh/mi300x-8.yaml"]:
        assert want in names


# Each shipped file is layered as a user would run it: a model file on the default mesh, a mesh file
# under the default (tiny) model, a recipe as it is. A mesh the tiny model cannot split over (tensor 8,
# its 4 heads) is layered under the shipped model it is written for.
UNDER = {"mesh/gpu-8-tp.yaml": ["model/llama3-8b.yaml"], "mesh/4x8-gpu.yaml": ["model/llama3-70b.yaml"],
         "mesh/4x8-gpu-pp.yaml": ["model/llama3-70b.yaml"]}
# The devices of a file whose mesh fills an axis (-1) from what is there: the hardware it is written
# for. Other meshes need the product of their sizes (x mesh.dcn), or mesh.cpu_devices; the default
# mesh (mesh.data=-1) of a model file alone runs on one device.
DEVICES = {"mesh/gpu-8.yaml": 8, "mesh/gpu-8-tp.yaml": 8, "mesh/mi300x-8.yaml": 8, "mesh/4x8-gpu.yaml": 32,
           "recipes/llama3-8b-8xh100.yaml": 8, "recipes/sft-tiny-cpu.yaml": 1,
           "recipes/tiny-llava-cpu.yaml": 1}
# Published parameter counts (GPT-2's with its vocabulary padded from 50257 to 50304 rows).
PARAMETERS = {"model/llama3-8b.yaml": 8_030_261_248, "model/llama3.1-8b.yaml": 8_030_261_248,
              "model/llama3-70b.yaml": 70_553_706_496, "model/mixtral-8x7b.yaml": 46_702_792_704,
              "model/llama-1b.yaml": 1_235_814_400, "model/gpt2-125m.yaml": 124_475_904,
              "recipes/llama3-8b-8xh100.yaml": 8_030_261_248, "recipes/llama3-70b-32xh100.yaml": 70_553_706_496,
              "recipes/llama3-70b-32xh100-fp8.yaml": 70_553_706_496, "recipes/mixtral-8x7b-32xh100.yaml": 46_702_792_704,
              # Qwen3-8B "8.19B" and Qwen3-30B-A3B "30.5B" (the Hub's safetensors totals)
              "model/qwen3-8b.yaml": 8_190_735_360, "model/qwen3-30b-a3b.yaml": 30_532_122_624}


def shipped_devices(name: str, cfg) -> int:
    """The devices the shipped file `name` (layered into `cfg`) is meant to run on."""
    ici = [getattr(cfg.mesh, a) for a in MESH_AXES]
    if name in DEVICES:
        return DEVICES[name]
    if cfg.mesh.cpu_devices:
        return cfg.mesh.cpu_devices
    if -1 in ici and not name.startswith("model/"):
        pytest.fail(f"{name} fills a mesh axis with -1: add the device count it is written for to DEVICES")
    return math.prod(max(v, 1) for v in ici) * math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)


def plan_and_spec(files: list[str], num_devices: int):
    """make_plan on `num_devices` and the model spec under abstract evaluation (no parameter is made)."""
    plan = make_plan(load_config(files), num_devices)
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab, mesh=None, rules=None)
    return plan, spec


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_shipped_config_loads(path):
    """Every shipped file loads, plans on the devices it is written for (the mesh divides the model's
    heads, ffn, hidden size, vocabulary, layers into stages, the batch), and builds its model abstractly."""
    name = str(path.relative_to(CONFIG_DIR))
    files = [*UNDER.get(name, []), str(path)]
    cfg = load_config(files)
    assert cfg.model.head_dim and cfg.model.num_kv_heads  # resolved
    n = shipped_devices(name, cfg)
    plan, spec = plan_and_spec(files, n)
    assert plan.num_devices == n, (plan.mesh_text(), n)
    leaves = jax.tree.leaves(spec.abstract_params)
    assert leaves and all(type(x) is jax.ShapeDtypeStruct for x in leaves)  # shapes only: nothing allocated
    count = sum(math.prod(x.shape) for x in leaves)
    if name in PARAMETERS:
        assert count == PARAMETERS[name], (name, count)
    assert spec.abstract_params["embed"]["embedding"].shape[0] == plan.padded_vocab


def test_a_recipe_whose_mesh_does_not_divide_its_model_fails(tmp_path):
    """The check above can fail: a copy of a shipped recipe with 4 heads on tensor 8 (and one with 30
    layers over 4 pipeline stages) is refused by make_plan, naming the key."""
    heads = tmp_path / "heads.yaml"
    heads.write_text(f"include: {CONFIG_DIR / 'recipes/llama3-8b-8xh100.yaml'}\n"
                     f"mesh:\n  fsdp: 1\n  tensor: 8\nmodel:\n  num_heads: 4\n  num_kv_heads: 4\n")
    with pytest.raises(MeshError, match="model.num_heads=4 is not divisible by mesh.tensor=8"):
        plan_and_spec([str(heads)], 8)
    layers = tmp_path / "layers.yaml"
    layers.write_text(f"include:\n  - {CONFIG_DIR / 'model/llama3-70b.yaml'}\n  - {CONFIG_DIR / 'mesh/4x8-gpu-pp.yaml'}\n"
                      f"model:\n  num_layers: 30\n")
    with pytest.raises(MeshError, match="model.num_layers=30 does not split into mesh.pipeline=4"):
        plan_and_spec([str(layers)], 32)


def test_presets_have_published_shapes():
    llama = load_config(["model/llama3-8b"]).model
    assert (llama.num_layers, llama.hidden_size, llama.num_heads, llama.num_kv_heads, llama.head_dim,
            llama.ffn_hidden_size, llama.vocab_size) == (32, 4096, 32, 8, 128, 14336, 128256)
    assert (llama.norm, llama.activation, llama.position_embedding, llama.tie_embeddings) == \
        ("rmsnorm", "swiglu", "rope", False)
    gpt = load_config(["model/gpt2-125m"]).model
    assert (gpt.norm, gpt.activation, gpt.position_embedding, gpt.use_bias, gpt.tie_embeddings) == \
        ("layernorm", "gelu", "learned", True, True)


def test_overrides_and_includes(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("model:\n  num_layers: 3\ntrain:\n  steps: 7\n")
    top = tmp_path / "top.yaml"
    top.write_text("include: base.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config([str(top)], ["optim.lr=1e-4", "mesh.dcn.data=2"])
    assert (cfg.model.num_layers, cfg.train.steps, cfg.optim.lr, cfg.mesh.dcn.data) == (3, 9, 1e-4, 2)
    assert parse_override("data.path=[0.3, a, 0.7, b]") == {"data": {"path": [0.3, "a", 0.7, "b"]}}


@pytest.mark.parametrize("override, words", [
    ("model.num_hedas=4", ["model.num_hedas", "did you mean model.num_heads"]),
    ("trian.steps=4", ["trian", "did you mean train"]),
    ("train.steps=abc", ["train.steps", "'abc'", "integer"]),
    ("train.precision=fp64", ["train.precision", "'fp64'", "fp32, bf16, fp16, fp8"]),
    ("precision.fp8_recipe=rowwise", ["precision.fp8_recipe", "'rowwise'", "delayed, current, tensorwise, blockwise, mxfp8"]),
    ("model.num_kv_heads=3", ["model.num_heads=4", "model.num_kv_heads=3"]),
    ("optim.min_lr=1.0", ["optim.min_lr=1.0", "optim.lr=0.002"]),
    ("parallel.virtual_stages=0", ["parallel.virtual_stages", "> 0"]),
    ("parallel.pipeline_schedule=zb", ["parallel.pipeline_schedule", "1f1b"]),
    ("mesh.tensor=0", ["mesh.tensor", "positive"]),
    ("train.steps", ["train.steps", "key.sub=value"]),
])
def test_bad_config_names_key_value_and_accepted(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_include_cycle_and_missing_file(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config([str(a)])
    with pytest.raises(ConfigError, match="not found"):
        load_config(["no/such/config.yaml"])


def test_mesh_fill_and_hybrid():
    cfg = load_config(overrides=["mesh.tensor=4", "mesh.data=-1"])
    assert mesh_sizes(make_mesh(cfg))["data"] == 2
    # 2 "nodes" x (tensor 4): data comes from the inter-node factor.
    cfg = load_config(overrides=["mesh.tensor=4", "mesh.data=-1", "mesh.dcn.data=2"])
    mesh = make_mesh(cfg)
    assert mesh_sizes(mesh)["data"] == 2 and mesh_sizes(mesh)["tensor"] == 4
    # tensor groups stay inside a node: devices 0-3 and 4-7
    groups = [sorted(d.id for d in row) for row in mesh.devices.reshape(2, 4)]
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("overrides, words", [
    (["mesh.data=3"], ["3 devices", "8 are available", "-1"]),
    (["mesh.tensor=8", "model.num_heads=8", "model.num_kv_heads=4"], ["model.num_kv_heads=4", "mesh.tensor=8"]),
    (["mesh.tensor=3", "mesh.data=1"], ["3 devices"]),
    (["mesh.data=8", "train.global_batch=4"], ["train.global_batch=4", "data-parallel size 8"]),
    (["mesh.tensor=2", "mesh.data=4", "parallel.sequence_parallel=true", "train.seq_len=33"],
     ["train.seq_len=33", "mesh.tensor"]),
    # (a hidden size FSDP's split does not divide is stored padded: tests/test_optimizer_sharding.py)
    (["mesh.tensor=8", "mesh.data=1", "model.num_heads=8", "model.num_kv_heads=8", "model.ffn_hidden_size=100"],
     ["model.ffn_hidden_size=100", "mesh.tensor=8"]),
])
def test_mesh_mismatch_says_which_size_to_change(overrides, words):
    with pytest.raises(MeshError) as e:
        cfg = load_config(overrides=overrides)
        make_plan(cfg, 8)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
