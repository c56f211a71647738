"""Batches: layout, document-aware fields, determinism (exact resume), prefetch, per-host reads."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax.data.gpt_dataset import GPTDataset
from megajax.data.indexed import IndexedDataset, IndexedDatasetWriter
from megajax.data.loader import Loader
from megajax.train.loop import train
from megajax.plan import BatchLayout
from conftest import xla_flags

EOD = 256  # the byte tokenizer's end-of-document id


@pytest.fixture
def corpus(tmp_path):
    """Documents of random lengths with ids 1..99, each ended by EOD."""
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "corpus_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(300):
            w.add_document(np.append(rng.integers(1, 100, rng.integers(5, 60)), EOD))
    return prefix


class Recording:
    def __init__(self, ds):
        self.ds, self.reads = ds, []

    def __getitem__(self, i):
        self.reads.append(i)
        return self.ds[i]


def make_loader(ds, accumulation=2, prefetch=0, spec=P(None, "data", None), keys=("tokens", "labels", "loss_mask"),
                eod_mask_loss=False):
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sh = NamedSharding(mesh, spec)
    layout = BatchLayout(global_batch=8, micro_batch=2 // accumulation, data_parallel=4,
                         accumulation=accumulation, seq_len=16)
    return Loader(ds, layout=layout, shardings={k: sh for k in keys}, eod_mask_loss=eod_mask_loss,
                  prefetch=prefetch)


def test_batch_layout_and_each_sample_read_once(corpus):
    ds = GPTDataset(IndexedDataset(corpus), seq_len=16, seed=1)
    rec = Recording(ds)
    batch = make_loader(rec).batch(24)
    assert batch["tokens"].shape == (2, 4, 16)
    assert sorted(rec.reads) == list(range(24, 32))  # 8 devices asked; every sample read exactly once
    tokens, labels = np.asarray(batch["tokens"]), np.asarray(batch["labels"])
    for a in range(2):
        for r in range(4):
            sample = ds[24 + a * 4 + r]["tokens"]
            np.testing.assert_array_equal(tokens[a, r], sample[:-1])
            np.testing.assert_array_equal(labels[a, r], sample[1:])
    np.testing.assert_array_equal(np.asarray(batch["loss_mask"]), 1.0)


def test_batches_depend_only_on_position_so_resume_is_exact(corpus):
    ds = GPTDataset(IndexedDataset(corpus), seq_len=16, seed=1)
    first, resumed = make_loader(ds, prefetch=2), make_loader(ds, prefetch=0)
    for start in (0, 8, 16):
        a = first.batch(start)
    b = resumed.batch(16)  # a fresh process starting at consumed_samples=16
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
    first.close()


class Slow(Recording):
    """Each sample takes `delay` seconds to read."""

    def __init__(self, ds, delay):
        super().__init__(ds)
        self.delay = delay

    def __getitem__(self, i):
        time.sleep(self.delay)
        return super().__getitem__(i)


def test_loader_counts_the_time_a_step_waits_for_data(corpus):
    ds = Slow(GPTDataset(IndexedDataset(corpus), seq_len=16, seed=1), delay=0.02)
    inline = make_loader(ds, prefetch=0)
    inline.batch(0)
    assert inline.wait_seconds >= 8 * 0.02  # read in the caller: all of it is waiting
    ahead = make_loader(ds, prefetch=1)
    ahead.batch(0)  # nothing queued yet: waits for it, and queues the next batch
    first = ahead.wait_seconds
    assert first >= 8 * 0.02
    time.sleep(1.0)  # a step far longer than reading a batch
    ahead.batch(8)
    assert ahead.wait_seconds - first < 0.5 * first  # it was read while the step ran
    ahead.close()


def test_document_aware_fields(corpus):
    ds = GPTDataset(IndexedDataset(corpus), seq_len=16, seed=1, document_aware=True, eod_id=EOD)
    batch = make_loader(ds, keys=("tokens", "labels", "loss_mask", "positions", "segment_ids"),
                        eod_mask_loss=True).batch(0)
    tokens, mask = np.asarray(batch["tokens"]), np.asarray(batch["loss_mask"])
    pos, seg = np.asarray(batch["positions"]), np.asarray(batch["segment_ids"])
    assert (tokens == EOD).any()
    np.testing.assert_array_equal(mask, (tokens != EOD).astype(np.float32))
    for row_t, row_p, row_s in zip(tokens.reshape(-1, 16), pos.reshape(-1, 16), seg.reshape(-1, 16)):
        for i in range(1, 16):
            after_eod = row_t[i - 1] == EOD
            assert row_p[i] == (0 if after_eod else row_p[i - 1] + 1)
            assert row_s[i] == row_s[i - 1] + after_eod


def test_train_on_megatron_dataset_with_validation_and_documents(small_config, corpus, tmp_path):
    plain = train(small_config(f"data.path={corpus}", "train.eval_every=2", "train.eval_steps=2",
                               "data.split=90,10,0", steps=4))
    records = [json.loads(l) for l in (plain.run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if "val_loss" in r]
    assert all(0.0 <= r["data_wait"] <= 1.0 for r in records if "loss" in r)
    assert [r["step"] for r in vals] == [2, 4] and vals[-1]["val_loss"] < vals[0]["val_loss"]
    assert vals[-1]["val_ppl"] == pytest.approx(np.exp(vals[-1]["val_loss"]))
    aware = train(small_config(f"data.path={corpus}", "data.split=90,10,0",
                               "data.reset_position_ids=true", "data.reset_attention_mask=true",
                               "data.eod_mask_loss=true", "mesh.data=2", "mesh.tensor=4", steps=4))
    assert np.all(np.isfinite(aware.losses))
    assert not np.allclose(aware.losses, plain.losses[:4])  # document boundaries reach the model


def test_blend_trains_and_reports(small_config, corpus, tmp_path, capsys):
    res = train(small_config(f"data.path=[0.3, {corpus}, 0.7, {corpus}]", steps=2))
    out = capsys.readouterr().out
    assert "blend of 2 datasets" in out and "weight 0.3000" in out
    assert len(res.losses) == 2


def test_two_processes_read_disjoint_rows_and_form_the_one_process_batch(corpus, tmp_path):
    """2 processes x 4 CPU devices: each reads only its rows; together they hold the 8-device batch."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(root))
    procs = [subprocess.Popen([sys.executable, str(root / "tests" / "multiprocess_loader_worker.py"), str(i),
                               str(port), corpus, str(tmp_path / f"p{i}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
    results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    assert all(r["devices"] == 8 and r["local"] == 4 for r in results)
    reads = [set(r["reads"]) for r in results]
    assert not reads[0] & reads[1] and reads[0] | reads[1] == set(range(16, 24))
    assert all(r["num_reads"] == len(r["reads"]) for r in results)  # no sample read twice

    ds = GPTDataset(IndexedDataset(corpus), seq_len=16, seed=1)
    want = make_loader(ds, accumulation=1, keys=("tokens", "labels")).batch(16)
    for key in ("tokens", "labels"):
        got = np.zeros(want[key].shape, np.int64)
        for r in results:
            for (a, b), data in r["shards"][key]:
                data = np.asarray(data)
                got[a:a + data.shape[0], b:b + data.shape[1]] = data
        np.testing.assert_array_equal(got, np.asarray(want[key]))
