"""Generated instruction data: small tasks with one right answer, for fine-tuning without a download.

    examples(split, count, seed) -> [(task, prompt, answer), ...]       deterministic for (split, seed)
    write_conversations(path, split, count, seed)                         {"messages": [user, assistant]} jsonl
    instruct_data(directory, count, held_out, seed) -> (train.jsonl, held-out.jsonl), written once
    instruct_train_file(), instruct_held_out_file()   the default set in the user cache (what
        data.format=chat with an empty data.path trains on, and train.exact_match_path defaults to)

The tasks, in turn:

    reverse: "reverse: plum"   -> "mulp"
    add:     "add: 13 + 8"     -> "21"
    sort:    "sort: 7 2 9"     -> "2 7 9"

A prompt belongs to the held-out split or to the training split by a hash of its text (one in
HELD_OUT_EVERY), so no held-out prompt is ever trained on, whatever the counts and seeds.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

TASKS = ("reverse", "add", "sort")
SPLITS = ("train", "held_out")
HELD_OUT_EVERY = 8  # one prompt in 8 (by hash) is held out
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _example(task: str, rng: random.Random) -> tuple[str, str]:
    if task == "reverse":
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 4)))
        return f"reverse: {word}", word[::-1]
    if task == "add":
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        return f"add: {a} + {b}", str(a + b)
    numbers = [rng.randint(0, 9) for _ in range(rng.randint(3, 4))]
    return f"sort: {' '.join(map(str, numbers))}", " ".join(map(str, sorted(numbers)))


def split_of(prompt: str) -> str:
    """The split a prompt belongs to (a hash of its text: stable across runs and Python versions)."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")
    return "held_out" if h % HELD_OUT_EVERY == 0 else "train"


def examples(split: str, count: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """`count` (task, prompt, answer) triples of `split`, the tasks in turn; the same for the same
    (split, count, seed). Prompts may repeat within the training split (the held-out one is small:
    its prompts are distinct while enough are left)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; accepted: {', '.join(SPLITS)}")
    rng = random.Random(f"{seed}-{split}")
    out: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < count:
        task = TASKS[len(out) % len(TASKS)]
        prompt, answer = _example(task, rng)
        tries += 1
        if split_of(prompt) != split or (split == "held_out" and prompt in seen and tries < 100 * count):
            continue
        seen.add(prompt)
        out.append((task, prompt, answer))
    return out


def conversation(prompt: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def write_conversations(path, split: str, count: int, seed: int = 0) -> Path:
    """`examples(split, count, seed)` as a jsonl of {"messages": [...]} lines; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for _, prompt, answer in examples(split, count, seed):
            f.write(json.dumps(conversation(prompt, answer)) + "\n")
    tmp.replace(path)
    return path


def instruct_data(directory, count: int = 6000, held_out: int = 96, seed: int = 0) -> tuple[Path, Path]:
    """(train.jsonl, held-out.jsonl) of generated conversations in `directory`, written unless a
    previous call with the same counts and seed wrote them."""
    d = Path(directory) / f"instruct-{count}-{held_out}-{seed}"
    train, held = d / "train.jsonl", d / "held-out.jsonl"
    if not train.is_file():
        write_conversations(train, "train", count, seed)
    if not held.is_file():
        write_conversations(held, "held_out", held_out, seed)
    return train, held


def _default() -> tuple[Path, Path]:
    from megajax.data.corpus import cache_dir
    return instruct_data(cache_dir() / "instruct")


def instruct_train_file() -> Path:
    return _default()[0]


def instruct_held_out_file() -> Path:
    return _default()[1]


def read_prompts(path) -> list[tuple[list[dict], str]]:  # train.exact_match_path
    """(the messages before the last, the last message's content: the expected answer) of each
    conversation in a jsonl file whose conversations end with an assistant's answer."""
    from megajax.data.text_files import json_line, text_lines
    from megajax.errors import DataError
    name = f"train.exact_match_path {str(path)!r}"
    out = []
    for n, line in text_lines(Path(path).expanduser(), name):
        if not line.strip():
            continue
        record = json_line(line, f"{name} line {n}")
        try:
            messages = record["messages"]
            *context, last = messages
            ok = last["role"] == "assistant" and isinstance(last["content"], str) and context
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise DataError(f"{name} line {n}: an exact-match set needs {{\"messages\": [..., "
                            f"{{\"role\": \"assistant\", \"content\": ANSWER}}]}}, got {line[:80]!r}.")
        out.append((context, last["content"]))
    return out
