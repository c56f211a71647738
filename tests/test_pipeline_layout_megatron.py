"""Megatron's pipeline layout flags in megajax (megajax/megatron_args.py): --pipeline-model-parallel-layout,
--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split become the
parallel.* layout keys, a layout string without --virtual-pipeline-model-parallel-size gives the virtual
stages as megatron-core derives them (its chunks / the pipeline size), and `megajax config from-megatron`
with a layout that does not fit is one error."""

from __future__ import annotations

import shlex

import pytest

from megajax import megatron_args as ma
from megajax.config import load_config
from megajax.pipeline_layout import resolve_layout
from test_bad_input import megajax, paragraph

MODEL = "--num-layers 10 --hidden-size 64 --num-attention-heads 8 --ffn-hidden-size 128 --seq-length 32"


def config_of(line: str):
    return load_config(base=ma.translate(shlex.split(line)).tree())


@pytest.mark.parametrize("flags, pp, virtual, chunks", [
    # A layout string: its 4 chunks over pipeline 2 give 2 virtual stages and the interleaved schedule.
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ettt|tt|ttt|ttL'", 2, 2, (3, 2, 3, 2)),
    # One chunk per stage: no virtual stages.
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*6|t*4L'", 2, 1, (6, 4)),
    # An explicit virtual size wins (and must agree with the string: checked when the layout resolves).
    ("--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
     "--pipeline-model-parallel-layout 'E|(ttt|)*2,ttttL'", 2, 2, (0, 3, 3, 4)),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 4", 2, 1, (4, 6)),
    ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1",
     4, 1, (1, 4, 4, 1)),
    ("--pipeline-model-parallel-size 4 --account-for-embedding-in-pipeline-split "
     "--account-for-loss-in-pipeline-split", 4, 1, (2, 3, 3, 2)),
])
def test_megatron_layout_flags_give_the_layout(flags, pp, virtual, chunks):
    cfg = config_of(f"{MODEL} {flags}")
    assert cfg.mesh.pipeline == pp and cfg.parallel.virtual_stages == virtual
    assert cfg.parallel.pipeline_schedule == ("interleaved" if virtual > 1 else "1f1b")
    assert resolve_layout(cfg, pp, virtual).chunks == chunks


def test_from_megatron_with_a_layout_that_does_not_fit_is_one_error(tmp_path):
    """A layout string whose t do not count --num-layers: one paragraph naming the key and the count,
    exit 2, nothing on stdout."""
    p = megajax("config", "from-megatron", "--", *shlex.split(MODEL), "--pipeline-model-parallel-size", "2",
                "--pipeline-model-parallel-layout", "Ettt|ttL", cwd=tmp_path)
    paragraph(p, "config", "parallel.pipeline_layout", "'Ettt|ttL'", "counts 5 decoder layers (t) but the model has 10")
    assert p.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_deepseek_v3s_published_layout_string_is_read_verbatim():
    """Megatron's DeepSeek-V3 layout at PP 16 x VP 2, 'Et*3|(tt|)*29,m|L': the MTP depth in a chunk of its
    own before the loss's. megajax runs the depth with the loss (on the last stage); the decoder layers
    sit where Megatron puts them: the same chunks as 'Et*3|(tt|)*29|mL'."""
    from megajax.pipeline_layout import layout_from_string
    m = load_config(["model/deepseek-v3"], ["model.mtp_num_layers=1"]).model
    ours = layout_from_string("Et*3|(tt|)*29,m|L", m, 16, 2)
    assert ours.chunks == (3, *(2,) * 29, 0, 0) == layout_from_string("Et*3|(tt|)*29|mL", m, 16, 2).chunks


@pytest.mark.parametrize("text, export, words", [
    ("Et|tm|t|L", False, "must follow every decoder layer"),
    ("Et|tt|mL", True, None),
    ("Et|ttm|L", True, "must all be in the last chunk"),
])
def test_mtp_depths_after_the_decoder_layers(text, export, words):
    """tiny-deepseek-v3 (3 layers, one MTP depth): training takes the depths anywhere after the last
    decoder layer; a legacy Megatron export needs them in the last rank's chunk (its file holds them)."""
    from megajax.checkpoint.megatron import stage_layers
    from megajax.errors import CheckpointError, MeshError
    from megajax.pipeline_layout import layout_from_string
    m = load_config(["model/tiny-deepseek-v3"]).model
    chunks = len(text.split("|"))
    if words is None:
        assert [len(r) for r in stage_layers(m, chunks, text)] == [1, 2, 0]
        return
    with pytest.raises(CheckpointError if export else MeshError, match=words):
        if export:
            stage_layers(m, chunks, text)
        else:
            layout_from_string(text, m, chunks, 1)
    if export:  # training reads it
        assert layout_from_string(text, m, chunks, 1).chunks == (1, 2, 0)
