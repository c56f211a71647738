"""Which decoder layers each pipeline chunk holds: Megatron-Core's layout string and its uneven-split flags.

    parallel.pipeline_layout = "Et*3|(tt|)*29,m|L"   ->   StageLayout(chunks=(3, 2, ..., 2, 0, 0), mtp_chunk=30)

A pipeline of P stages with V virtual stages (model chunks) per stage has P x V chunks, numbered in
model order virtual-stage-major: chunk c = v x P + s is virtual stage v of stage s, and holds the
decoder layers after those of chunks 0..c-1. A layout names how many each chunk holds:

- `parallel.pipeline_layout`: Megatron's string (its --pipeline-model-parallel-layout), read as
  Megatron-Core's PipelineParallelLayerLayout reads it: `|` between chunks (virtual-stage-major),
  E the embedding, L the loss, t a decoder layer, m a multi-token prediction depth; `(...)*n`
  repeats a group, `x*n` a character; commas are cosmetic; a chunk may be empty.
- `parallel.first_pipeline_stage_layers` / `parallel.last_pipeline_stage_layers` (Megatron's
  --decoder-first/last-pipeline-num-layers): the first and last stage's layers, the rest split
  evenly over the middle stages, each stage's layers evenly over its V chunks.
- `parallel.account_for_embedding_in_pipeline_split` / `..._loss_...`: the embedding (loss) counts
  as a layer of the first (last) chunk, which then holds one decoder layer fewer.
- A hybrid model's `|` in model.hybrid_layer_pattern: its chunks as Megatron reads them.
- None of these: the even split (a dense-first model's dense layers in the first chunk, the rest
  split evenly; groups of a hybrid's pattern or of dense layers between MoE layers kept whole).

`resolve_layout` checks a layout against the model and the pipeline (one clear error naming the
key, what it counted and what is accepted) and returns the chunks' layer counts; which layer of
which kind runs where follows from them (megajax/models/layer_plan.py). (It reads the config it is
given and imports none: megajax/config.py checks the string's syntax with `parse_layout`.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megajax.errors import ConfigError, MeshError

LAYOUT_KEY = "parallel.pipeline_layout"
LAYER_CHARS = {"E": "the embedding", "L": "the loss", "t": "a decoder layer", "m": "a multi-token prediction depth"}
# Megatron-Core's expansion of repeats: first a parenthesised group, then a single character.
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_CHAR = re.compile(r"(.)\*(\d+)")
MAX_CHUNKS = 1 << 16  # a layout naming more chunks than this is refused before it is expanded


@dataclass(frozen=True)
class StageLayout:
    """The decoder layers of each of the P x V chunks (chunk c = v x P + s, model order) and where
    the multi-token prediction depths run (`mtp_chunk`, the last chunk: with the loss)."""
    stages: int
    virtual: int
    chunks: tuple[int, ...]  # decoder layers per chunk, in model order
    source: str  # how the layout was given, for messages ("the even split", "parallel.pipeline_layout=...")

    def __post_init__(self):
        assert len(self.chunks) == self.stages * self.virtual, (self.chunks, self.stages, self.virtual)

    @property
    def num_layers(self) -> int:
        return sum(self.chunks)

    def chunk(self, stage: int, virtual: int) -> int:
        return virtual * self.stages + stage

    def first_layer(self, c: int) -> int:
        return sum(self.chunks[:c])

    def layers(self, c: int) -> range:
        """The model layers chunk c holds."""
        first = self.first_layer(c)
        return range(first, first + self.chunks[c])

    def stage_layers(self, s: int) -> int:
        return sum(self.chunks[self.chunk(s, v)] for v in range(self.virtual))

    def is_even(self) -> bool:
        return len(set(self.chunks)) == 1

    def megatron(self, mtp_layers: int = 0) -> str:
        """The layout as Megatron's string (E first, L last, the MTP depths before L), runs of equal
        chunks written `(...|)*n`."""
        parts = ["t" * n for n in self.chunks]
        parts[0] = "E" + parts[0]
        parts[-1] = parts[-1] + "m" * mtp_layers + "L"
        pieces, i = [], 0
        while i < len(parts) - 1:  # runs of equal chunks before the last: (body|)*n
            n = 1
            while i + n < len(parts) - 1 and parts[i + n] == parts[i]:
                n += 1
            body = _short(parts[i])
            pieces.append("|" * n if not body else f"({body}|)*{n}" if n > 1 else f"{body}|")
            i += n
        return "".join(pieces) + _short(parts[-1])

    def describe(self) -> str:
        """`stage s: chunks (n, n, ...)` per distinct stage, one line."""
        rows = []
        for s in range(self.stages):
            sizes = [self.chunks[self.chunk(s, v)] for v in range(self.virtual)]
            rows.append(f"stage {s}: " + (str(sizes[0]) if self.virtual == 1 else "(" + ", ".join(map(str, sizes)) + ")"))
        return "; ".join(rows)


def _short(stage: str) -> str:
    """A chunk's characters with runs of 3 or more t written t*n."""
    return re.sub(r"t{3,}", lambda m: f"t*{len(m.group(0))}", stage)


def parse_layout(text: str, key: str = LAYOUT_KEY) -> list[str]:
    """A Megatron layout string's chunks, each its characters (E, L, t, m) with repeats expanded and
    commas dropped; ConfigError naming `key` for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{key} = {text!r}: expected Megatron's layout string, e.g. 'Et*3|(tt|)*29,m|L' "
                          f"(E the embedding, L the loss, t a decoder layer, m a multi-token prediction depth, "
                          f"'|' between chunks).")
    flat = text.replace(",", "").replace(" ", "")
    counts = [int(n) for n in re.findall(r"\*(\d+)", flat)]
    size = len(flat)
    for n in counts:  # bound the expansion before doing it (a user's string must not run unbounded)
        size *= max(n, 1)
        if size > 64 * MAX_CHUNKS:
            raise ConfigError(f"{key} = {text!r}: its repeats expand to more than {64 * MAX_CHUNKS:,} characters; "
                              f"a layout names at most {MAX_CHUNKS:,} chunks.")
    for pattern in (_GROUP, _CHAR):
        flat = pattern.sub(lambda m: m.group(1) * int(m.group(2)), flat)
    bad = sorted(set(flat) - set(LAYER_CHARS) - {"|"})
    if bad:
        raise ConfigError(f"{key} = {text!r}: {', '.join(repr(c) for c in bad)} "
                          f"{'is' if len(bad) == 1 else 'are'} not part of Megatron's layout syntax; accepted: "
                          f"{', '.join(f'{c} ({what})' for c, what in LAYER_CHARS.items())}, '|' between chunks, "
                          f"'(...)*n' and 'x*n' repeats, commas.")
    return flat.split("|")


def _hint(p: int, v: int) -> str:
    return f"mesh.pipeline={p} x parallel.virtual_stages={v}"


def layout_from_string(text: str, m: ModelConfig, p: int, v: int, key: str = LAYOUT_KEY,
                       where: str = "", mtp_last: bool = False) -> StageLayout:
    """The chunks of a Megatron layout string for a model of `m` on P stages x V virtual stages,
    checked as Megatron-Core checks it (and megajax's one restriction: the multi-token prediction
    depths run with the loss, on the last stage: they must follow every decoder layer, and a chunk of
    their own before L's, DeepSeek-V3's '...|m|L', is read as run with the loss; `mtp_last`: they
    must be in the last chunk itself, as a legacy export's rank files hold them). `where`: what gives P
    and V, for messages (default the mesh and parallel.virtual_stages)."""
    chunks = parse_layout(text, key)
    where = where or _hint(p, v)
    layers = len(m.hybrid_pattern()) if m.hybrid_layer_pattern else m.num_layers
    flat = "".join(chunks)
    problems = []
    if len(chunks) != p * v:
        ok = [f"mesh.pipeline={d} x parallel.virtual_stages={len(chunks) // d}" for d in range(1, len(chunks) + 1)
              if len(chunks) % d == 0][:4]
        problems.append(f"it names {len(chunks)} chunks but this run has {where} = {p * v} (a layout names "
                        f"exactly one chunk per virtual stage of every stage; {len(chunks)} chunks fit "
                        f"{', '.join(ok)})")
    if flat.count("t") != layers:
        problems.append(f"it counts {flat.count('t')} decoder layers (t) but the model has {layers} "
                        f"(model.{'hybrid_layer_pattern' if m.hybrid_layer_pattern else 'num_layers'})")
    if flat.count("E") != 1 or not chunks[0].startswith("E"):
        problems.append(f"the embedding E must be named once, first in the first chunk (it has {flat.count('E')}"
                        f"{'' if chunks[0].startswith('E') else ', and the first chunk starts ' + repr(chunks[0][:1] or 'empty')})")
    if flat.count("L") != 1 or not chunks[-1].endswith("L"):
        problems.append(f"the loss L must be named once, last in the last chunk (it has {flat.count('L')}"
                        f"{'' if chunks[-1].endswith('L') else ', and the last chunk ends ' + repr(chunks[-1][-1:] or 'empty')})")
    depths = m.mtp_num_layers or 0
    if flat.count("m") != depths:
        problems.append(f"it counts {flat.count('m')} multi-token prediction depths (m) but model.mtp_num_layers="
                        f"{depths}")
    elif depths:
        holding = [c for c, chunk in enumerate(chunks) if "m" in chunk]
        after = "".join(chunks[holding[0]:])  # from the first depth to the end
        if (mtp_last and holding != [len(chunks) - 1]) or "t" in after[after.index("m"):]:
            where = holding
            problems.append(f"its multi-token prediction depths (m, in chunk{'s' if len(where) > 1 else ''} "
                            f"{', '.join(map(str, where))}) must " + ("all be in the last chunk, after its decoder "
                            f"layers and before L, as the last pipeline rank's file holds them (e.g. '...|tmL')"
                            if mtp_last else "follow every decoder layer (e.g. '...|tmL' or '...|m|L'): megajax "
                            "runs them with the loss, on the last stage"))
    if problems:
        raise MeshError(f"{key} = {text!r}: " + "; ".join(problems) + ".")
    return StageLayout(p, v, tuple(c.count("t") for c in chunks), f"{key}={text!r}")


def layout_from_ends(cfg: Config, p: int, v: int) -> StageLayout:
    """Megatron's --decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split,
    as Megatron-Core distributes the layers (transformer_block.get_num_layers_to_build)."""
    par, m = cfg.parallel, cfg.model
    first, last = par.first_pipeline_stage_layers, par.last_pipeline_stage_layers
    emb, loss = par.account_for_embedding_in_pipeline_split, par.account_for_loss_in_pipeline_split
    layers = len(m.hybrid_pattern()) if m.hybrid_layer_pattern else m.num_layers
    keys = []
    if first is not None:
        keys.append(f"parallel.first_pipeline_stage_layers={first}")
    if last is not None:
        keys.append(f"parallel.last_pipeline_stage_layers={last}")
    if emb:
        keys.append("parallel.account_for_embedding_in_pipeline_split=true")
    if loss:
        keys.append("parallel.account_for_loss_in_pipeline_split=true")
    given = " with ".join(keys)
    where = f"{given} (model with {layers} decoder layers, {_hint(p, v)} = {p * v})"
    if first is not None or last is not None:
        middle_layers, middle_stages = layers, p
        for key, n in (("first", first), ("last", last)):
            if n is None:
                continue
            if n % v:
                raise MeshError(f"{where}: the {key} stage's {n} layers do not split into its {v} virtual stages; "
                                f"use a multiple of {v}.")
            middle_layers -= n
            middle_stages -= 1
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
            raise MeshError(f"{where}: {middle_layers} layers are left for {middle_stages} middle stages; every "
                            f"middle stage needs layers and every layer a stage (the first and last stage's "
                            f"layers may add up to at most {layers}, exactly {layers} with mesh.pipeline=2).")
        per = middle_layers // middle_stages if middle_stages else 0
        if middle_stages and (middle_layers % middle_stages or per % v):
            raise MeshError(f"{where}: the {middle_layers} layers left do not split evenly into {middle_stages} "
                            f"middle stage{'s' if middle_stages > 1 else ''} of {v} chunk{'s' if v > 1 else ''} "
                            f"each (a multiple of {middle_stages * v} is needed).")
        sizes = [per] * p
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        chunks = [sizes[s] // v for vs in range(v) for s in range(p)]
    else:
        total = layers + emb + loss
        if total % (p * v):
            raise MeshError(f"{where}: {layers} layers + {int(emb) + int(loss)} do not split evenly into {p * v} "
                            f"chunks ({total} is not a multiple of {p * v}).")
        chunks = [total // (p * v)] * (p * v)
        chunks[0] -= emb
        chunks[-1] -= loss
        if min(chunks) < 0:
            raise MeshError(f"{where}: the first or last chunk would hold fewer than no layers.")
    return StageLayout(p, v, tuple(chunks), given)


def layout_from_pattern(m: ModelConfig, p: int, v: int) -> StageLayout:
    """A hybrid model's chunks from the `|` in model.hybrid_layer_pattern."""
    stages = m.hybrid_layer_pattern.split("|")
    if len(stages) != p * v:
        raise MeshError(f"model.hybrid_layer_pattern = {m.hybrid_layer_pattern!r} marks {len(stages)} pipeline stages "
                        f"('|', one per chunk: virtual-stage-major) but this run has {_hint(p, v)} = {p * v}; make "
                        f"them agree, "
                        f"or leave the '|' out to split the pattern's repeats evenly.")
    return StageLayout(p, v, tuple(len(s) for s in stages), f"model.hybrid_layer_pattern={m.hybrid_layer_pattern!r}")


def even_layout(m: ModelConfig, p: int, v: int, fixes: str = "") -> StageLayout:
    """The split without a layout: equal chunks of the model's unit (a layer; a group of a hybrid's
    pattern or of a MoE layer and the dense layers after it), a dense-first model's dense layers in
    the first chunk. MeshError when the units do not divide (`fixes`: what else would fit)."""
    n = p * v
    k = m.dense_first_layers()
    if m.hybrid_layer_pattern:
        unit, what = len(m.hybrid_group()), f"repeat(s) of the group {m.hybrid_group()!r} of model.hybrid_layer_pattern"
    elif m.interleaves_dense_layers():
        unit, what = m.moe_layer_freq, f"groups of one MoE and {m.moe_layer_freq - 1} dense layers (model.moe_layer_freq)"
    else:
        unit, what = 1, "layers" if not k else f"MoE layers (the {k} dense ones run in the first chunk)"
    units = (m.num_layers - k) // unit
    if units % n:
        raise MeshError(f"the model's {units} {what} do not split evenly into {_hint(p, v)} = {p * v} chunks; "
                        f"{fixes or 'change the mesh'}, or give the chunks' layers: " + layout_keys_hint())
    chunks = [units // n * unit] * n
    chunks[0] += k
    return StageLayout(p, v, tuple(chunks), "the even split")


def layout_keys_hint() -> str:
    return ("parallel.pipeline_layout (Megatron's layout string, e.g. 'Et*3|(tt|)*29,m|L'), or "
            "parallel.first_pipeline_stage_layers / parallel.last_pipeline_stage_layers.")


def layout_given(cfg: Config) -> list[str]:
    """The keys that give a layout (beside a hybrid pattern's '|')."""
    par = cfg.parallel
    out = []
    if par.pipeline_layout is not None:
        out.append(f"{LAYOUT_KEY}={par.pipeline_layout!r}")
    if par.first_pipeline_stage_layers is not None:
        out.append(f"parallel.first_pipeline_stage_layers={par.first_pipeline_stage_layers}")
    if par.last_pipeline_stage_layers is not None:
        out.append(f"parallel.last_pipeline_stage_layers={par.last_pipeline_stage_layers}")
    if par.account_for_embedding_in_pipeline_split:
        out.append("parallel.account_for_embedding_in_pipeline_split=true")
    if par.account_for_loss_in_pipeline_split:
        out.append("parallel.account_for_loss_in_pipeline_split=true")
    return out


def resolve_layout(cfg: Config, p: int, v: int, fixes: str = "") -> StageLayout:
    """The chunks of a run with P pipeline stages x V virtual stages (P > 1): from the layout keys,
    a hybrid pattern's '|', or the even split (MeshError / ConfigError naming the keys otherwise)."""
    par, m = cfg.parallel, cfg.model
    given = layout_given(cfg)
    if par.pipeline_layout is not None and len(given) > 1:
        raise ConfigError(f"{' and '.join(given)}: a layout string names every chunk's layers, so it takes none of "
                          f"the other layout keys (Megatron refuses them together too); keep one.")
    if (par.first_pipeline_stage_layers is not None or par.last_pipeline_stage_layers is not None) and (
            par.account_for_embedding_in_pipeline_split or par.account_for_loss_in_pipeline_split):
        raise ConfigError(f"{' and '.join(given)}: the first/last stage's layer counts and the account-for-embedding/"
                          f"loss split do not go together (Megatron refuses them together too); keep one of the two.")
    if m.hybrid_layer_pattern and "|" in m.hybrid_layer_pattern and given:
        raise ConfigError(f"{' and '.join(given)} with model.hybrid_layer_pattern = {m.hybrid_layer_pattern!r}: the "
                          f"pattern's '|' already marks the chunks; drop one of the two.")
    if par.pipeline_layout is not None:
        return layout_from_string(par.pipeline_layout, m, p, v)
    if given:
        return layout_from_ends(cfg, p, v)
    if m.hybrid_layer_pattern and "|" in m.hybrid_layer_pattern:
        return layout_from_pattern(m, p, v)
    return even_layout(m, p, v, fixes)


def check_without_pipeline(cfg: Config) -> None:
    """The layout keys need pipeline parallelism (mesh.pipeline > 1): one clear error otherwise."""
    given = layout_given(cfg)
    if given:
        raise ConfigError(f"{' and '.join(given)}: a pipeline layout needs pipeline parallelism (mesh.pipeline > 1; "
                          f"this run has mesh.pipeline=1); drop the key or set mesh.pipeline.")
