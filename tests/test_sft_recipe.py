"""The embedded fine-tuning recipe (`megajax train --config recipes/sft-tiny-cpu`): generated instruction
data, chat-packed and trained on the answers; exact-match accuracy on held-out prompts rises well above
the base model's. Also the generator's determinism and split, and the evaluator on known answers."""

import json

import numpy as np
import pytest

from megajax.cli import run_training
from megajax.config import load_config
from megajax.data import instruct_tasks
from megajax.errors import DataError


def test_generated_tasks_are_deterministic_and_held_out_apart(tmp_path):
    train = instruct_tasks.examples("train", 600, seed=3)
    held = instruct_tasks.examples("held_out", 60, seed=3)
    assert train == instruct_tasks.examples("train", 600, seed=3) and train != instruct_tasks.examples("train", 600)
    assert not {p for _, p, _ in train} & {p for _, p, _ in held}
    assert len({p for _, p, _ in held}) == 60 and {t for t, _, _ in held} == set(instruct_tasks.TASKS)
    for task, prompt, answer in held:
        args = prompt.split(": ", 1)[1]
        expected = {"reverse": lambda: args[::-1], "add": lambda: str(sum(int(x) for x in args.split(" + "))),
                    "sort": lambda: " ".join(sorted(args.split(), key=int))}[task]()
        assert answer == expected, (prompt, answer)
    path = instruct_tasks.write_conversations(tmp_path / "h.jsonl", "held_out", 5)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [m["role"] for m in lines[0]["messages"]] == ["user", "assistant"]
    assert instruct_tasks.read_prompts(path)[0] == (lines[0]["messages"][:1], lines[0]["messages"][1]["content"])
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DataError, match="line 1"):
        instruct_tasks.read_prompts(tmp_path / "bad.jsonl")


def test_recipe_sft_tiny_cpu_raises_held_out_accuracy(tmp_path, capsys):
    cfg = load_config(["recipes/sft-tiny-cpu"], [f"train.run_dir={tmp_path / 'run'}", "logging.progress=false",
                                                 "mesh.data=1"])
    result = run_training(cfg, devices=__import__("jax").devices()[:1])
    out = capsys.readouterr().out
    before, after = result.exact_match["before"], result.exact_match["after"]
    assert "exact-match accuracy before training" in out and "exact-match accuracy after training" in out
    assert before <= 0.05 and after >= before + 0.2, (before, after)
    assert np.isfinite(result.losses).all() and result.losses[-1] < 0.5 * result.losses[0]
