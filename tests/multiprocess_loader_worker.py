"""One process of the two-process loader tests (run by tests/test_loader.py and tests/test_sft_data.py,
not by pytest): argv process_id port data out [chat]; with `chat`, data is a jsonl file of conversations
read as data.format=chat reads it (the byte tokenizer, test_sft_data's Llama 3 style template)."""

import json
import sys

import jax
import numpy as np

process_id, port, prefix, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=60)

from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from megajax.data.gpt_dataset import GPTDataset  # noqa: E402
from megajax.data.indexed import IndexedDataset  # noqa: E402
from megajax.data.loader import Loader  # noqa: E402
from megajax.plan import BatchLayout  # noqa: E402

reads = []


class Recording:
    def __init__(self, ds):
        self.ds = ds

    def __getitem__(self, i):
        reads.append(int(i))
        return self.ds[i]


mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
sh = NamedSharding(mesh, P(None, "data", None))
if sys.argv[5:] == ["chat"]:
    from test_sft_data import chat_dataset  # noqa: E402
    dataset, keys = chat_dataset(prefix), ("tokens", "labels", "loss_mask", "positions", "segment_ids")
else:
    dataset, keys = GPTDataset(IndexedDataset(prefix), seq_len=16, seed=1), ("tokens", "labels")
layout = BatchLayout(global_batch=8, micro_batch=2, data_parallel=4, accumulation=1, seq_len=dataset.seq_len)
loader = Loader(Recording(dataset), layout=layout, shardings={k: sh for k in keys}, prefetch=0,
                eod_mask_loss=sys.argv[5:] == ["chat"])
batch = loader.batch(16)
shards = {k: [[[s.start or 0 for s in shard.index[:2]], np.asarray(shard.data).tolist()]
              for shard in batch[k].addressable_shards] for k in batch}
json.dump({"reads": sorted(set(reads)), "num_reads": len(reads), "shards": shards,
           "devices": jax.device_count(), "local": jax.local_device_count()}, open(out, "w"))
jax.distributed.shutdown()
