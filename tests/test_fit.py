"""Memory fit advice: only changes the devices can run and that fit by the analytic estimate, else
the smallest combination that fits, else a plain statement that nothing does."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SMALL
from megajax.cli import main
from megajax.errors import MeshError
from megajax.perf.analytic import memory_estimate
from megajax.perf.fit import advice, check_fit
from megajax.plan import make_plan
from megajax.train.state import build_model_spec

ROOT = Path(__file__).resolve().parent.parent
LLAMA_8B = ["--config", "model/llama3-8b", "train.global_batch=64", "train.seq_len=4096"]


def _cli(*args, devices=1):
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "megajax.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def _overrides(phrase: str) -> list[str]:
    """The key=value overrides of one advice phrase such as 'a=1 b=2 + c=3 (-1.00 GiB est., 7.00 GiB)'."""
    return [w for w in phrase.split(" (")[0].replace(" + ", " ").split() if "=" in w]


def _topology(tmp_path, args, topology) -> dict:
    out = tmp_path / "topo.json"
    assert main(["bench", *args, "--topology", topology, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_topology_advice_is_a_combination_that_fits_when_no_single_change_does(tmp_path):
    # The user's command line: every change offered before fitted no better than 'does NOT fit'.
    p = _cli("bench", *LLAMA_8B, "mesh.data=-1", "--topology", "8xH100", "--json", str(tmp_path / "t.json"))
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "t.json").read_text())
    assert r["fits"] is False
    assert len(r["advice"]) == 1 and " + " in r["advice"][0], r["advice"]
    assert "try " + r["advice"][0] in p.stdout
    combination = _overrides(r["advice"][0])
    assert _topology(tmp_path, [*LLAMA_8B, "mesh.data=-1", *combination], "8xH100")["fits"] is True
    # ... and it is the smallest: no part of it fits alone.
    for part in r["advice"][0].split(" (")[0].split(" + "):
        assert _topology(tmp_path, [*LLAMA_8B, "mesh.data=-1", *part.split()], "8xH100")["fits"] is False


def test_topology_single_changes_each_fit_and_one_device_gets_no_mesh_change(tmp_path):
    args = ["--config", "model/llama-1b", "train.global_batch=8"]
    r = _topology(tmp_path, args, "1xH100")
    assert r["fits"] is False and len(r["advice"]) >= 2, r["advice"]
    for phrase in r["advice"]:
        assert " + " not in phrase and "mesh." not in phrase, phrase
        assert _topology(tmp_path, [*args, *_overrides(phrase)], "1xH100")["fits"] is True, phrase
    assert any("train.micro_batch=" in a for a in r["advice"])


def test_topology_says_when_nothing_fits(tmp_path):
    r = _topology(tmp_path, LLAMA_8B, "1xH100")
    [phrase] = r["advice"]
    assert phrase.startswith("more devices") and "no change of recompute or micro batch on this 1 device" in phrase
    assert "mesh." not in phrase and "still needs" in phrase
    # On 8 devices layouts are tried as well, and the statement says so.
    r = _topology(tmp_path, [*LLAMA_8B, "train.seq_len=65536", "train.global_batch=8"], "8xH100")
    assert r["advice"][0].startswith("more devices") and "or layout on these 8 devices" in r["advice"][0]


def test_train_fit_check_on_one_device_offers_no_mesh_change():
    # The user's command line on a one-device machine: mesh.tensor=2 used to be among the tips.
    p = _cli("train", *SMALL, "model.num_layers=1", "train.steps=1", "train.device_memory_gib=0.0001")
    assert p.returncode == 2, p.stderr
    msg = p.stderr
    assert msg.startswith("megajax train: error: the compiled train step needs") and "Traceback" not in msg
    assert "mesh." not in msg and "on this 1 device fits by the analytic estimate" in msg, msg


def test_measured_fit_check_offers_the_change_that_fits(small_config):
    """The measured figure (here: the analytic one plus 1 MiB of XLA overhead) just above the
    capacity: halving the micro batch fits, so it is offered; tensor parallelism is never offered on
    one device, and every offered change fits by its estimate."""
    plan = make_plan(small_config("train.seq_len=128", "model.vocab_size=257"), 1)
    micro = plan.cfg.train.global_batch
    assert plan.batch.micro_batch == micro
    tips = advice(plan)
    assert tips.variants and not any("mesh." in v.describe() for v in tips.variants)
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab)
    needed = memory_estimate(plan, spec)["total"] + 2**20
    half = next(v for v in tips.variants if v.describe() == f"train.micro_batch={micro // 2}")
    capacity = needed + half.delta + 1
    with pytest.raises(MeshError) as e:
        check_fit(needed, capacity, "test", tips)
    msg = str(e.value)
    assert f"train.micro_batch={micro // 2} (" in msg and "mesh." not in msg, msg
    for phrase in tips.phrases(needed, capacity):
        number, unit = re.search(r", ([\d.]+) ([KMGT]i)?B\)$", phrase).groups()
        after = float(number) * 2 ** (10 * " KMGT".index((unit or " ")[0]))
        assert after <= capacity * 1.01, phrase


def test_moe_advice_uses_the_plans_micro_batch(small_config):
    """A MoE run over mesh.expert=2 x mesh.data=4: the data-parallel size is 8 (expert ranks split the
    batch outside the MoE layers), so global batch 16 is micro batch 2. Each piece of advice must be the
    difference between the analytic estimates of the plan with the change and the plan without it;
    taking the data-parallel size as data x fsdp (4) made every variant without its own
    train.micro_batch use micro batch 4."""
    moe = ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "mesh.data=4", "mesh.expert=2",
           "train.global_batch=16"]
    plan = make_plan(small_config(*moe), 8)
    assert plan.batch.micro_batch == 2 and plan.batch.data_parallel == 8
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab)

    def estimate(p):
        return memory_estimate(p, spec)["total"]

    now = estimate(plan)
    tips = advice(plan, spec=spec)
    checked = 0
    for v in tips.variants:
        if len(v.options) != 1 or v.options[0].kind != "recompute":
            continue
        changed = make_plan(small_config(*moe, *v.options[0].overrides), 8)
        assert changed.batch.micro_batch == 2
        assert v.delta == estimate(changed) - now, v.describe()
        checked += 1
    assert checked == 2  # recompute=selective and recompute=full
