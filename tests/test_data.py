"""gt.data.get_dataloader: one shard per data-parallel rank, shared by a replica's model ranks."""

import pytest
import torch
from helpers.harness import run_distributed
from torch.utils.data import TensorDataset

import gridtrain as gt

PM = gt.ParallelMode
N = 40


def _read(ctx, shuffle, seed):
    ds = TensorDataset(torch.arange(N))
    dl = gt.data.get_dataloader(ds, batch_size=4, shuffle=shuffle, seed=seed)
    epochs = []
    for epoch in range(2):
        dl.sampler.set_epoch(epoch)
        epochs.append([b[0].tolist() for b in dl])
    return ctx.local_rank(PM.DATA), epochs


def test_shards_per_data_rank_not_per_global_rank():
    # world 4 = data 2 x tensor 2: the two tensor ranks of a replica must read the same data
    config = dict(parallel=dict(tensor=dict(size=2, mode="sequence")))
    results = run_distributed(_read, 4, True, 7, config=config, timeout=300)
    by_data_rank = {}
    for data_rank, epochs in results:
        assert by_data_rank.setdefault(data_rank, epochs) == epochs, "same data within a replica"
        for batches in epochs:
            assert all(len(b) == 4 for b in batches), "batch_size is per data-parallel rank"
    for epoch in range(2):
        shards = [sum(by_data_rank[r][epoch], []) for r in (0, 1)]
        assert not set(shards[0]) & set(shards[1]), "data ranks get disjoint shards"
        assert sorted(shards[0] + shards[1]) == list(range(N)), "together they cover the dataset"
    assert by_data_rank[0][0] != by_data_rank[0][1], "set_epoch reshuffles"
    again = run_distributed(_read, 4, True, 7, config=config, timeout=300)
    assert [r[1] for r in again] == [r[1] for r in results], "deterministic for a seed"
    other = run_distributed(_read, 4, True, 8, config=config, timeout=300)
    assert [r[1] for r in other] != [r[1] for r in results], "the seed changes the order"


def test_unshuffled_single_process_reads_in_order():
    ((_, epochs),) = run_distributed(_read, 1, False, 0, timeout=300)
    assert sum(epochs[0], []) == list(range(N))


def test_bad_batch_size_names_the_argument():
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        gt.data.get_dataloader(TensorDataset(torch.arange(4)), batch_size=0)
