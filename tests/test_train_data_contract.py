"""train_data's contract beyond the pipeline tests: make_loader's settings with worker processes
(none started here), split_indices' refusals, a missing shard, the fp8 forward pre-hook on a
module, the dataset's length."""

import json

import numpy as np
import pytest
import torch

from eagle3lib import shard_writer, shards, train_data
from eagle3lib.errors import UserError


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


def bare_shard(path, valid):
    n = len(valid)
    return shards.Shard(
        path=path,
        hidden_states=None,
        input_ids=np.zeros(n, np.int32),
        loss_mask=np.ones(n, np.uint8),
        offsets=np.arange(n + 1),
        row_starts=np.arange(n),
        valid=np.array(valid, np.uint8),
    )


# Catches: the refusal of fewer than two samples (none rejected) deleted: one sample then
# gave an empty training set and validation on it; the rejected count added, not subtracted.
def test_fewer_than_two_usable_samples_are_refused_with_the_counts(tmp_path):
    for found in ([], [bare_shard(tmp_path / "shard-0.safetensors", [1])]):
        with pytest.raises(UserError) as info:
            train_data.split_indices(found, 0.1)
        assert str(info.value) == (
            f"only {len(found)} usable sample(s) in the shards; training needs at least 2 "
            "(raise data.train.max_samples)"
        )
    found = [
        bare_shard(tmp_path / f"shard-{s}.safetensors", v) for s, v in enumerate([[0, 1], [0]])
    ]
    with pytest.raises(UserError) as info:
        train_data.split_indices(found, 0.1)
    assert str(info.value).startswith(
        f"{tmp_path}/shard-0.json, {tmp_path}/shard-1.json: 2 sample(s) rejected for non-finite "
        "(NaN/inf) hidden states, 1 usable; training needs at least 2"
    )


# Catches: the cache key's `stat and stat.st_size` (mtime too) without its `stat and`: a
# missing shard then fails with AttributeError instead of the damaged-shard line.
def test_a_missing_shard_is_a_damaged_shard(tmp_path):
    manifest = tmp_path / "shard-0.json"
    manifest.write_text(json.dumps({"file": {"bytes": 8, "sha256": "0" * 64}}))
    shard = tmp_path / "shard-0.safetensors"
    with pytest.raises(UserError) as info:
        train_data.open_verified_shards([shard], [manifest], {})
    assert str(info.value) == (
        f"{shard}: missing shard; removed its manifest {manifest}: rerun the workflow to rebuild "
        "this shard"
    )
    assert not manifest.exists()


# Catches: the hook's pass-through of batches without fp8 keys deleted (it then fails on
# them); the dequantized keys checked against dequantize_fp8 of the same bytes.
def test_fp8_hook_dequantizes_fp8_batches_and_passes_others_unchanged():
    seen = []

    class Draft(torch.nn.Module):
        def forward(self, **kwargs):
            seen.append(kwargs)

    draft = Draft()
    draft.register_forward_pre_hook(train_data.fp8_inputs(torch.float32), with_kwargs=True)
    plain = {"hidden_states": torch.ones(1, 3, 8), "input_ids": torch.arange(3)[None]}
    draft(**plain)
    assert seen[-1].keys() == plain.keys()
    assert all(seen[-1][k] is v for k, v in plain.items())
    states = torch.randn(1, 3, 3, 4, generator=torch.Generator().manual_seed(0))
    values, scales = shards.quantize_fp8(states)
    aux, last = values.view(torch.uint8)[..., :-1, :], values.view(torch.uint8)[..., -1, :]
    draft(
        fp8_aux=aux.flatten(-2),
        fp8_aux_scales=scales[..., :-1],
        fp8_last=last,
        fp8_last_scales=scales[..., -1],
        input_ids=plain["input_ids"],
    )
    back = shards.dequantize_fp8(values, scales, torch.float32)
    assert seen[-1].keys() == {"hidden_states", "verifier_last_hidden_states", "input_ids"}
    assert seen[-1]["hidden_states"].shape == (1, 3, 8)
    assert torch.equal(seen[-1]["hidden_states"], back[..., :-1, :].flatten(-2))
    assert torch.equal(seen[-1]["verifier_last_hidden_states"], back[..., -1, :])
    assert seen[-1]["hidden_states"].dtype == torch.float32


# Catches: __len__ returning None (the DataLoader never asks with a batch sampler).
def test_the_dataset_has_one_item_per_pair(tmp_path):
    assert len(tiny_dataset(tmp_path)) == 3
