"""Text in, text out: prompts encoded and batched, completions decoded (whole, or as a stream).

`complete` serves `megajax generate` and the end-of-training sample; `IncrementalText` turns a
growing list of token ids into text deltas that never split a character (a byte-level token
may hold part of one).
"""

from __future__ import annotations

from typing import Sequence

from megajax.inference.generate import Completion, Generator
from megajax.inference.sampling import Sampling


def completion_text(tokenizer, completion: Completion) -> str:
    """The completion's text, without the end-of-document token that ended it."""
    ids = completion.completion_ids[:-1] if completion.finish_reason == "stop" else completion.completion_ids
    return tokenizer.decode(ids)


def complete(generator: Generator, tokenizer, prompts: Sequence[str], sampling: Sampling, max_new_tokens: int,
             batch_size: int = 16) -> list[dict]:
    """One dict per prompt: prompt, prompt_ids, completion_ids, text (the completion), finish_reason,
    and the timing of the batch it ran in (time_to_first_token_s, decode_tokens_per_s, batch_size,
    compile_s). Prompt i samples with seed sampling.seed + i (greedy ignores seeds)."""
    encoded = [tokenizer.encode(p) for p in prompts]
    generator.check(encoded, [max_new_tokens] * len(encoded))
    out: list[dict] = []
    for first in range(0, len(prompts), batch_size):
        ids = encoded[first:first + batch_size]
        samplings = [Sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed + first + i)
                     for i in range(len(ids))]
        done, timing = generator.generate(ids, samplings, max_new_tokens)
        for i, c in enumerate(done):
            out.append({"prompt": prompts[first + i], "prompt_ids": c.prompt_ids, "completion_ids": c.completion_ids,
                        "text": completion_text(tokenizer, c), "finish_reason": c.finish_reason,
                        "time_to_first_token_s": timing.time_to_first_token_s,
                        "decode_tokens_per_s": timing.decode_tokens_per_s, "batch_size": timing.batch,
                        "compile_s": timing.compile_s})
    return out


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
