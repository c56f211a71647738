"""Exact-match accuracy on held-out prompts: greedy answers from the model, compared with the expected ones.

    exact_match(generator, tokenizer, template, items, max_new_tokens) -> (accuracy, answers)
    exact_match_hook(when) -> a train-loop hook printing `accuracy` before the first step or after the last

An item is (messages, expected answer): the conversation up to the answer is rendered with the chat
template and its generation prompt (the same rendering the chat data is trained with,
megajax/data/chat.py), the model answers greedily (megajax/inference/generate.py) until the
end-of-document token, a newline or `max_new_tokens`, and the answer counts when it equals the expected
one with surrounding whitespace stripped.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from megajax.data.chat import checked_chat_template, conversation_error
from megajax.data.chat_template import ChatTemplateError, render_chat, special_token
from megajax.inference.generate import Generator
from megajax.inference.sampling import Sampling
from megajax.inference.text import completion_text
from megajax.precision.policy import precision_policy

GREEDY = Sampling(0.0, 0, 1.0, 0)


def exact_match(generator: Generator, tokenizer, template: str, items: Sequence[tuple[list[dict], str]],
                max_new_tokens: int, batch_size: int = 32, source: str = "") -> tuple[float, list[str]]:
    """(fraction of items answered exactly, the answers in order)."""
    specials = dict(bos_token=special_token(tokenizer, "bos_token"), eos_token=special_token(tokenizer, "eos_token"))
    prompts = []
    for i, (messages, _) in enumerate(items):
        try:
            prompts.append(tokenizer.encode(render_chat(template, messages, add_generation_prompt=True, **specials)))
        except ChatTemplateError as e:
            raise conversation_error(e, f"held-out prompt {i + 1}", source) from None
    answers: list[str] = []
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        done, _ = generator.generate(batch, [GREEDY] * len(batch), max_new_tokens)
        answers += [completion_text(tokenizer, c).split("\n")[0].strip() for c in done]
    right = sum(a == expected.strip() for a, (_, expected) in zip(answers, items))
    return right / max(len(items), 1), answers


def _items(cfg) -> tuple[list[tuple[list[dict], str]], str]:
    from megajax.data.instruct_tasks import instruct_held_out_file, read_prompts
    from megajax.errors import DataError
    path = cfg.train.exact_match_path or str(instruct_held_out_file())
    items = read_prompts(path)[:cfg.train.exact_match_prompts]
    if not items:
        raise DataError(f"train.exact_match_path = {path!r} holds no conversations; give a jsonl of held-out "
                        f"conversations ending with the expected answer, or set train.exact_match_prompts=0.")
    return items, path


def scored_model(m, state, params=None) -> tuple:
    """(model config, parameters) a train state generates with (`params`: its parameters as generation
    reads them, default state.params): its own, or with model.lora the frozen
    base with the adapters merged in (W + alpha / rank A B, megajax.checkpoint.lora.merge_adapters: what
    `megajax generate` runs on the run's checkpoint), a model without adapters. The merged kernels are a
    second copy of the adapted ones on the devices while the prompts are scored."""
    params = state.params if params is None else params
    if m.lora is None:
        return m, params
    import dataclasses
    import numpy as np
    from megajax.checkpoint.lora import merge_adapters
    from megajax.checkpoint.source import flatten, unflatten
    from megajax.models.lora import is_adapter
    from megajax.models.trainable import join
    trained = dict(flatten(params))
    adapters = {k: np.asarray(jax.device_get(x), np.float32) for k, x in trained.items()
                if is_adapter(tuple(k.split("/")))}
    base = join(state.frozen, unflatten({k: x for k, x in trained.items() if k not in adapters}))
    return dataclasses.replace(m, lora=None), merge_adapters(base, m.lora, adapters, m, "the run's adapters")


def exact_match_hook(when: str) -> Callable:
    """A train-loop hook (`on_start` with when="before", `on_end` with "after") that, with
    train.exact_match_prompts > 0 in a one-process run, scores that many held-out prompts of
    train.exact_match_path (empty: the generated instruction tasks' held-out split), prints
    `exact-match accuracy <when> ...` and keeps it in result.exact_match[when]."""

    def hook(trainer, result, say: Callable[[str], None]) -> None:
        cfg = trainer.cfg
        if cfg.train.exact_match_prompts <= 0 or jax.process_count() != 1:
            return
        state = result.state if when == "after" else trainer.state
        items, path = _items(cfg)
        tok = trainer.tokenizer
        model, params = scored_model(cfg.model, state, trainer.setup.model_params(state))
        generator = Generator(model, params, padded_vocab_size=trainer.plan.padded_vocab,
                              dtype=precision_policy(cfg).inference_dtype, mesh=trainer.mesh,
                              rules=trainer.rules.activations, eod_id=getattr(tok, "eod_id", None),
                              layer_buffers=False,
                              expert_bias=None if state.moe_expert_bias is None
                              else jax.device_get(state.moe_expert_bias))
        longest = max(len(tok.encode(expected)) for _, expected in items) + 2  # the answer, its newline
        template, source = checked_chat_template(tok)
        accuracy, _ = exact_match(generator, tok, template, items, longest, source=source)
        result.exact_match[when] = accuracy
        say(f"megajax: exact-match accuracy {when} training: {accuracy:.3f} "
            f"({round(accuracy * len(items))}/{len(items)} held-out prompts of {path}, greedy)")

    return hook
