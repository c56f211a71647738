"""Checkpoints written by a real Megatron release (tests/fixtures/megatron_core_0_19, made by
scripts/megatron_fixtures.py with megatron-core 0.19.2's own parse_args + validate_args +
save_checkpoint at TP 2 or EP 2): they import by default, without megatron-core, with the logits
megatron-core recorded; a file naming a class outside Megatron's and PyTorch's is refused by name
and read with --trust-checkpoint; megajax's 0.19-form torch_dist export has the layout the release
writes."""

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megajax.checkpoint.common import resolved_model  # noqa: E402
from megajax.checkpoint.megatron import export_torch_dist, import_megatron  # noqa: E402
from megajax.checkpoint.source import DictSource  # noqa: E402
from megajax.checkpoint.torch_dist import DistCheckpoint  # noqa: E402
from megajax.checkpoint.torch_pickle import MegatronObject  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.errors import CheckpointError  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402

pytest.importorskip("torch")
FIXTURES = Path(__file__).with_name("fixtures") / "megatron_core_0_19"
NAMES = ("gpt-tp2-torch_dist", "moe-tp2-torch_dist", "gpt-tp2-torch", "moe-ep2-torch")


def logits_of(overrides: dict, params, tokens) -> np.ndarray:
    cfg = load_config(base={"model": overrides}, overrides=[f"train.seq_len={tokens.shape[1]}"])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    return np.asarray(spec.apply(params, tokens.astype(np.int32)))[..., :cfg.model.vocab_size]


def test_the_fixtures_are_what_the_release_wrote():
    for name in NAMES:
        said = json.loads((FIXTURES / name / "release.json").read_text())
        assert said["megatron_core"].startswith("0.19.") and said["args_fields"] > 800, said
        assert (FIXTURES / name / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert {p.name for p in (FIXTURES / "moe-ep2-torch" / "iter_0000010").iterdir()} == {"mp_rank_00_000",
                                                                                           "mp_rank_00_001"}
    assert {p.name for p in (FIXTURES / "gpt-tp2-torch" / "iter_0000010").iterdir()} == {"mp_rank_00", "mp_rank_01"}
    step = DistCheckpoint(FIXTURES / "moe-tp2-torch_dist" / "iter_0000010")
    assert "common_state/shard_0_1" in step.byte_keys() and not (step.step / "common.pt").exists()


@pytest.mark.parametrize("name", NAMES)
def test_a_release_checkpoint_imports_with_megatron_cores_logits(name):
    save = FIXTURES / name
    overrides, params = import_megatron(save)
    m = resolved_model(overrides)
    assert (m.num_layers, m.hidden_size, m.num_heads) == (2, 64, 4)
    assert m.num_experts == (4 if name.startswith("moe") else 0)
    tokens, theirs = np.load(save / "tokens.npy"), np.load(save / "logits.npy")
    np.testing.assert_allclose(logits_of(overrides, params, tokens), theirs[..., :m.vocab_size], atol=1e-4, rtol=1e-4)


def test_release_args_read_without_megatron_code(tmp_path):
    """The import runs in a process where megatron cannot be imported at all; Megatron's enums in args
    come back as stand-ins that keep their class name and read as their values."""
    code = f"""
import sys
class NoMegatron:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError("megatron is not installed here")
sys.meta_path.insert(0, NoMegatron())
from megajax.checkpoint.megatron import _args
step, args = _args({str(FIXTURES / "moe-tp2-torch_dist")!r}, False)
print(type(args.attention_backend).__mro__[1].__name__, args.attention_backend.megatron_class,
      args.attention_backend == args.attention_backend.value, args.num_experts, len(vars(args)))
print(sorted(m for m in sys.modules if m.startswith("megatron")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    first, modules = out.stdout.strip().splitlines()
    kind, name, equal, experts, fields = first.split()
    assert (kind, name, equal, experts) == ("MegatronObject", "megatron.core.transformer.enums.AttnBackend", "True", "4")
    assert int(fields) > 800 and modules == "[]"


def rewrite_common_state(step: Path, change) -> None:
    """Replaces a 0.19 torch_dist step's common_state entry with change(common state) (a shard file of its own)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from megajax.checkpoint.torch_pickle import load
    ckpt = DistCheckpoint(step)
    common = load(io.BytesIO(ckpt.read_bytes("common_state/shard_0_1")))[0]
    for key, value in vars(common["args"]).items():  # stand-ins are not picklable: their plain values
        if isinstance(value, MegatronObject):
            setattr(common["args"], key, value.value)
    buffer = io.BytesIO()
    torch.save([change(common)], buffer)
    (step / "__9_0.distcp").write_bytes(buffer.getvalue())
    md = pickle.loads((step / ".metadata").read_bytes())
    md.storage_data[MetadataIndex("common_state/shard_0_1")] = _StorageInfo("__9_0.distcp", 0, len(buffer.getvalue()))
    (step / ".metadata").write_bytes(pickle.dumps(md))


def test_a_foreign_class_is_refused_by_name_and_read_when_trusted(tmp_path, capsys):
    import datetime
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "gpt-tp2-torch_dist", save)

    def with_date(common):
        common["args"].started = datetime.date(2026, 12, 1)
        return common
    rewrite_common_state(save / "iter_0000010", with_date)
    assert main(["import", "--format", "megatron", "--input", str(save), "--output", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "common_state/shard_0_1' holds a Python object of datetime.date" in err
    assert "pass --trust-checkpoint" in err and "checkpoint.trust_load=true" in err
    assert not (tmp_path / "a").exists()
    assert main(["import", "--format", "megatron", "--input", str(save), "--output", str(tmp_path / "b"),
                 "--trust-checkpoint"]) == 0
    _, trusted = import_megatron(save, trust=True)
    _, plain = import_megatron(FIXTURES / "gpt-tp2-torch_dist")
    np.testing.assert_array_equal(trusted["embed"]["embedding"], plain["embed"]["embedding"])
    with pytest.raises(CheckpointError, match="datetime.date"):
        import_megatron(save)
    from megajax.checkpoint.stored_model import train_config  # checkpoint.load, with checkpoint.trust_load
    with pytest.raises(CheckpointError, match="datetime.date.*checkpoint.trust_load=true"):
        train_config(overrides=[f"checkpoint.load={save}", "train.seq_len=16"])
    trusted_cfg = train_config(overrides=[f"checkpoint.load={save}", "checkpoint.trust_load=true", "train.seq_len=16"])
    assert trusted_cfg.model.hidden_size == 64


def test_trusted_loading_keeps_megatron_classes_as_stand_ins():
    """--trust-checkpoint unpickles fully, yet a release's classes that the installed megatron-core (if any)
    lacks, such as 0.19's InferenceCudaGraphScope, still come back as stand-ins."""
    from megajax.checkpoint.megatron import _args
    _, args = _args(FIXTURES / "gpt-tp2-torch", True)
    assert isinstance(args.inference_cuda_graph_scope, MegatronObject)
    overrides, params = import_megatron(FIXTURES / "gpt-tp2-torch", trust=True)
    assert overrides == import_megatron(FIXTURES / "gpt-tp2-torch")[0]


def test_stand_ins_compare_as_their_values():
    from megajax.checkpoint.torch_pickle import stand_in
    backend = stand_in("megatron.core.transformer.enums.AttnBackend")
    assert backend(5) == 5 and backend(5) == backend(5) and backend(5) != backend(4)
    assert isinstance(backend(5), MegatronObject) and repr(backend(5)) == "megatron.core.transformer.enums.AttnBackend(5)"
    assert stand_in("megatron.core.transformer.enums.AttnBackend") is backend


@pytest.mark.parametrize("name", ["gpt-tp2-torch_dist", "moe-tp2-torch_dist"])
def test_the_0_19_export_has_the_layout_the_release_writes(name, tmp_path):
    """megajax's torch_dist export (--megatron-version 0.19) of the release's model: the same model keys with
    the same global shapes and dtypes, the same _extra_state objects, the common state where 0.19 keeps it
    (no common.pt), the same metadata.json; only the RNG states (which megatron-core loads with
    --no-load-rng) are not written. (scripts/megatron_fixtures.py --check-export loads such an export in
    megatron-core 0.19 itself, strictly.)"""
    overrides, params = import_megatron(FIXTURES / name)
    out = export_torch_dist(DictSource(params, resolved_model(overrides)), tmp_path / "out", dtype="fp32",
                            iteration=10, megatron_version="0.19")
    theirs = DistCheckpoint(FIXTURES / name / "iter_0000010")
    ours = DistCheckpoint(out / "iter_0000010")
    assert {k: (theirs.shape(k), str(theirs.meta[k].properties.dtype)) for k in theirs.keys()} == \
        {k: (ours.shape(k), str(ours.meta[k].properties.dtype)) for k in ours.keys()}
    assert set(ours.byte_keys()) == {k for k in theirs.byte_keys() if not k.startswith("rng_state/")}
    assert not (out / "iter_0000010" / "common.pt").exists()
    assert json.loads((out / "iter_0000010" / "metadata.json").read_text()) == \
        json.loads((FIXTURES / name / "iter_0000010" / "metadata.json").read_text())
    _, back = import_megatron(out)
    np.testing.assert_array_equal(back["embed"]["embedding"], params["embed"]["embedding"])
