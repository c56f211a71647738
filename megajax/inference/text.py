"""Text in, text out: prompts encoded and batched, completions decoded (whole, or as a stream).

`complete` serves `megajax generate`, `training_sample` the end-of-training sample (a hook
`megajax train` hands to the training loop); `IncrementalText` turns a growing list of token
ids into text deltas that never split a character (a byte-level token may hold part of one).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from megajax.inference.generate import Completion, Generator
from megajax.inference.sampling import Sampling
from megajax.precision.policy import precision_policy


def completion_text(tokenizer, completion: Completion) -> str:
    """The completion's text, without the end-of-document token that ended it."""
    ids = completion.completion_ids[:-1] if completion.finish_reason == "stop" else completion.completion_ids
    return tokenizer.decode(ids)


def complete(generator: Generator, tokenizer, prompts: Sequence[str], sampling: Sampling, max_new_tokens: int,
             batch_size: int = 16, images=None, tiles: list[int] | None = None) -> list[dict]:
    """One dict per prompt: prompt, prompt_ids, completion_ids, text (the completion), finish_reason,
    and the timing of the batch it ran in (time_to_first_token_s, decode_tokens_per_s, batch_size,
    compile_s). Prompt i samples with seed sampling.seed + i (greedy ignores seeds). `images`
    [N, image_size, image_size, 3] (megajax.inference.images.preprocess'd): the images of every prompt,
    at its `<image>` markers (first, without one); tiled (preprocess_tiles), their tiles, image after
    image, `tiles` saying how many each image has."""
    if images is not None and len(images):
        from megajax.inference.images import image_prompt_ids
        if generator.model.vision is None:
            generator.check_images([[]], [images])  # the error: a text-only model
        count = len(images) if tiles is None else len(tiles)
        encoded = [image_prompt_ids(tokenizer, p, count, generator.model.vision, tiles) for p in prompts]
    else:
        images = None
        encoded = [tokenizer.encode(p) for p in prompts]
    generator.check(encoded, [max_new_tokens] * len(encoded))
    out: list[dict] = []
    for first in range(0, len(prompts), batch_size):
        ids = encoded[first:first + batch_size]
        samplings = [Sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed + first + i)
                     for i in range(len(ids))]
        done, timing = generator.generate(ids, samplings, max_new_tokens,
                                          None if images is None else [images] * len(ids))
        for i, c in enumerate(done):
            out.append({"prompt": prompts[first + i], "prompt_ids": c.prompt_ids, "completion_ids": c.completion_ids,
                        "text": completion_text(tokenizer, c), "finish_reason": c.finish_reason,
                        "time_to_first_token_s": timing.time_to_first_token_s,
                        "decode_tokens_per_s": timing.decode_tokens_per_s, "batch_size": timing.batch,
                        "compile_s": timing.compile_s})
    return out


FALLBACK_PROMPT = "def "  # the sample's prompt when the run has no held-out split
PROMPT_LINES, PROMPT_CHARS = 3, 160  # how much of a held-out document the sample starts from


def held_out_prompt(tokenizer, samples, max_tokens: int = PROMPT_CHARS, limit: int = 256) -> str | None:
    """The sample's prompt from the held-out split: the first whole lines (up to PROMPT_LINES, within
    PROMPT_CHARS characters and `max_tokens` tokens) of a document in one of its first `limit` samples,
    starting at a line that is neither blank nor indented (a sample starts mid-document; its first line
    is cut); None if none has one."""
    eod = getattr(tokenizer, "eod_id", None)
    for k in range(min(limit, len(samples))):
        sample = samples[k]
        ids = [int(t) for t in (sample["tokens"] if isinstance(sample, dict) else sample)]
        cuts = [i for i, t in enumerate(ids) if t == eod]
        for start, end in zip([-1] + cuts, cuts + [len(ids)]):
            lines = tokenizer.decode(ids[start + 1:end]).split("\n")[(1 if start < 0 else 0):-1]
            while lines and (not lines[0].strip() or lines[0][0].isspace()):
                lines.pop(0)
            kept: list[str] = []
            for line in lines[:PROMPT_LINES]:
                text = "\n".join(kept + [line]) + "\n"
                if len(text) > PROMPT_CHARS or len(tokenizer.encode(text)) > max_tokens or "\ufffd" in line:
                    break
                kept.append(line)
            if kept:
                return "\n".join(kept) + "\n"
    return None


def end_of_training_sample(trainer, params, expert_bias=None) -> tuple[str, str, str]:
    """(prompt, prompt + completion, the settings in words): up to train.sample_tokens new tokens within the
    context, stopping at end-of-document, sampled from train.sample_prompt (or a held-out document's first
    lines: held_out_prompt) with train.sample_temperature, train.sample_top_p and seed train.seed, by
    cached generation on the run's mesh (what `megajax generate` with those settings prints).

    `trainer` is a megajax.train.setup.Trainer (read for its config, tokenizer, plan, mesh, rules and
    validation loader)."""
    cfg, tok, t = trainer.cfg, trainer.tokenizer, trainer.cfg.train
    eod = getattr(tok, "eod_id", None)
    # layer_buffers=False: the scanned layers read the training state's parameters where they are
    # (per-layer copies would add a model's worth of memory at the end of training).
    generator = Generator(cfg.model, params, padded_vocab_size=trainer.plan.padded_vocab,
                          dtype=precision_policy(cfg).inference_dtype, mesh=trainer.mesh,
                          rules=trainer.rules.activations, eod_id=eod, layer_buffers=False,
                          expert_bias=None if expert_bias is None else jax.device_get(expert_bias))
    prompt, where = t.sample_prompt, "train.sample_prompt"
    if not prompt:  # a held-out document's first lines, within half the context
        valid = trainer.valid_loader
        held = held_out_prompt(tok, valid.dataset, generator.context // 2) if valid is not None else None
        prompt, where = ((held, "the first lines of a held-out document") if held else
                         (FALLBACK_PROMPT, "no held-out split" if valid is None else "no whole line held out"))
    sampling = Sampling(t.sample_temperature, 0, t.sample_top_p, t.seed)
    settings = (f"prompt: {where}; " + ("greedy" if not sampling.temperature else
                                       f"temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, seed {sampling.seed}"))
    ids = tok.encode(prompt) or ([eod] if eod is not None else [])
    budget = min(t.sample_tokens, generator.context - len(ids))
    if not ids or budget < 1:
        return prompt, prompt, settings
    [done], _ = generator.generate([ids], [sampling], budget)
    return prompt, prompt + completion_text(tok, done), settings


def training_sample(trainer, result, say: Callable[[str], None]) -> None:
    """End-of-training hook (megajax.train.loop.train's `on_end`): with train.sample_tokens > 0 in a
    one-process run, the sample from the final state (end_of_training_sample), printed with its settings
    and kept in `result.sample` (its prompt in `result.sample_prompt`)."""
    if trainer.cfg.train.sample_tokens <= 0 or jax.process_count() != 1:
        return
    if trainer.cfg.model.vision is not None:
        say("megajax: no end-of-training sample: the text generator does not run vision-language models "
            "(model.vision) yet; train.sample_tokens=0 leaves this line out.")
        return
    state = result.state
    result.sample_prompt, result.sample, settings = end_of_training_sample(trainer, trainer.setup.model_params(state),
                                                                           state.moe_expert_bias)
    say(f"megajax: sample from the trained model ({settings}):\n" + result.sample)


class IncrementalText:
    """Text of a growing token list, handed out in deltas; a delta never ends inside a character."""

    def __init__(self, tokenizer, stop_id: int | None = None):
        self.tokenizer, self.stop_id = tokenizer, stop_id
        self.ids: list[int] = []
        self.sent = ""

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(int(i) for i in ids if i != self.stop_id)
        text = self.tokenizer.decode(self.ids)
        if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop sequence begins in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` may begin a stop sequence (a stream keeps them back)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


def cut_at_stop(tokenizer, ids: Sequence[int], stops: Sequence[str]) -> tuple[str, int] | None:
    """(the text before the first stop sequence, the number of tokens that reach the end of that stop
    sequence) for completion tokens `ids`, or None when no stop sequence occurs. Stop sequences match
    the decoded text, across token boundaries."""
    text = tokenizer.decode(ids)
    cut = first_stop(text, stops)
    if cut is None:
        return None
    lo, hi = 1, len(ids)  # the smallest prefix whose text holds a stop sequence (monotone in the length)
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(tokenizer.decode(ids[:mid]), stops) is None:
            lo = mid + 1
        else:
            hi = mid
    return text[:cut], lo


class StopText:
    """IncrementalText cut at the first stop sequence: deltas never hand out text that may begin a stop
    sequence, and nothing after one. `stopped` turns True once a stop sequence appeared."""

    def __init__(self, tokenizer, stop_id: int | None, stops: Sequence[str]):
        self.text = IncrementalText(tokenizer, stop_id)
        self.stops = list(stops)
        self.full, self.sent, self.stopped = "", 0, False

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.full += self.text.add(ids, final)
        cut = first_stop(self.full, self.stops)
        if cut is not None:
            self.stopped, end = True, cut
        else:
            end = len(self.full) if final else len(self.full) - held_back(self.full, self.stops)
        delta = self.full[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return delta
