"""make_loader's DataLoader settings with worker processes (none started here)."""

import numpy as np
import torch

from eagle3lib import shard_writer, shards, train_data


def tiny_dataset(tmp_path):
    layout = shards.ShardLayout((3, 2, 4), 2, 4)
    path = tmp_path / "s.safetensors"
    writer = shard_writer.ShardWriter(path, layout, {"format": "test"})
    for i in layout.put_order:
        writer.put_states(i, torch.ones(layout.lengths[i], 2, 4))
    writer.close(np.arange(layout.tokens), np.ones(layout.tokens, np.uint8))
    return train_data.ShardDataset([path], [(0, 0), (0, 1), (0, 2)], 16, torch.float32)


# Catches: workers > 0 given without speculators' loader settings (spawned, persistent
# workers, prefetch 4) and those settings given to the thread-fed loader (workers 0).
def test_loader_with_workers_uses_speculators_settings_and_without_them_none(tmp_path):
    ds = tiny_dataset(tmp_path)
    loader = train_data.make_loader(ds, 16, 4, 1, seed=0, workers=2)
    assert loader.num_workers == 2 and loader.prefetch_factor == 4
    assert loader.persistent_workers
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert loader.worker_init_fn is not None
    plain = train_data.make_loader(ds, 16, 4, 1, seed=0)
    assert plain.num_workers == 0 and not plain.persistent_workers
    assert plain.multiprocessing_context is None and plain.worker_init_fn is None
