"""dali_nerf.data.seeds reproduces, bit for bit, the formulas each module used before they moved there
(the references below are those formulas, copied): any change is a behaviour change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dali_nerf.data import seeds
from dali_nerf.sources import PixelSampler, window_plan
from dali_nerf.train.runtime import seed_everything, step_generator

M64 = (1 << 64) - 1


def old_mix64(*vals):  # dali_nerf/loader.py::_mix64 before the move
    h = 0x9E3779B97F4A7C15
    for v in vals:
        h = (h ^ (int(v) & M64)) & M64
        h = (h + 0x9E3779B97F4A7C15) & M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & M64
        h ^= h >> 31
    return h


CASES = [(0, 0, 0, 0), (1, 2, 3, 4), (2**40 + 7, 5, 11, 3), (123456789, 1, 0, 99)]


@pytest.mark.parametrize("seed,rank,a,b", CASES)
def test_mixes_match_the_old_formulas(seed, rank, a, b):
    assert seeds.mix64(seed, rank, a, b) == old_mix64(seed, rank, a, b)
    assert seeds.window_key(seed, rank, a, b) == old_mix64(seed, rank, a, b) & ((1 << 63) - 1)
    assert seeds.block_seed(seed, rank, a) == old_mix64(seed, rank, a, 0) & ((1 << 63) - 1)
    assert seeds.perm_seed(seed, rank, a) == old_mix64(seed, rank, a, 1) & ((1 << 63) - 1)
    keys = seeds.window_order_keys(seed, rank, a, [0, 5, b])
    assert keys.dtype == np.uint64 and keys.tolist() == [old_mix64(seed, rank, a, i) for i in (0, 5, b)]


@pytest.mark.parametrize("seed,rank,step,cell", [(0, 0, 1, -1), (7, 1, 500, 3), (2**31 + 5, 3, 10**6, 0)])
def test_training_seeds_match_the_old_formulas(seed, rank, step, cell):
    assert seeds.process_seed(seed, rank) == (seed * 1000003 + rank) % (2**31)
    old = (seed * 6364136223846793005 + (rank + 1) * 1442695040888963407 + step * 97 + (cell + 1) * 7919) % (2**63)
    assert seeds.step_seed(seed, rank, step, cell) == old
    assert step_generator(seed, rank, step, cell).initial_seed() == old
    assert seeds.init_seed(seed) == seed and seeds.init_seed(seed, cell) == seed * 1009 + cell
    seed_everything(seed, rank)
    assert torch.initial_seed() == (seed * 1000003 + rank) % (2**31)


def test_init_seed_wraps_at_two_to_the_64():
    """A cell's init seed at and past 2**64 (a seed above ~1.8e16) is reduced mod 2**64, which
    ``torch.manual_seed`` accepts; just below it, and for the DDP replica, it is unchanged."""
    seed, cell = divmod(2**64, 1009)  # seed * 1009 + cell == 2**64 exactly
    assert seeds.init_seed(seed, cell) == 0
    assert seeds.init_seed(seed, cell - 1) == 2**64 - 1
    assert seeds.init_seed(seed, cell + 7) == 7
    big = 3 * 2**64 + 12345
    assert seeds.init_seed(big, 0) == (big * 1009) % 2**64
    torch.manual_seed(seeds.init_seed(seed, cell + 7))  # accepted (it raised for values >= 2**64)


def test_routed_streams():
    assert seeds.routed_stream(cell=3) == 3 and seeds.routed_stream(slot=2) == 10_002
    assert seeds.routed_stream(workers_cell=1) == 20_001  # SS torch_workers (was 20_000 + cell inline)
    with pytest.raises(ValueError, match="^routed_stream: give exactly one of cell, slot, workers_cell$"):
        seeds.routed_stream()
    with pytest.raises(ValueError, match="^routed_stream: give exactly one of cell, slot, workers_cell$"):
        seeds.routed_stream(cell=1, slot=1)


def test_window_plan_uses_the_order_keys():
    ids = np.arange(10, 17)
    got = np.concatenate(window_plan(ids, 3, seed=4, rank=1, cycle=2))
    ref = ids[np.argsort(np.array([old_mix64(4, 1, 2, int(i)) for i in ids], np.uint64), kind="stable")]
    assert got.tolist() == ref.tolist()


def test_pixel_sampler_streams_use_the_block_and_perm_seeds():
    class Cache:  # two 2x2 images (the sampler reads only these fields)
        pixels = np.zeros((8, 3), np.uint8)
        layout = np.array([[0, 2, 2, 0], [4, 2, 2, 1]], np.int64)
        num_pixels = 8

    class Scene:
        c2w = np.tile(np.eye(4, dtype=np.float32)[:3], (2, 1, 1))
        intrinsics = np.array([[2, 2, 1, 1]] * 2, np.float32)
        has_bounds = False

    ps = PixelSampler(Cache(), Scene(), seed=9, rank=1, mode="random")
    g = torch.Generator().manual_seed(old_mix64(9, 1, 64, 0) & ((1 << 63) - 1))
    assert torch.equal(ps.pixel_ids(64, 5), torch.randint(0, 8, (5,), generator=g))
    pe = PixelSampler(Cache(), Scene(), seed=9, rank=1, mode="epoch")
    g = torch.Generator().manual_seed(old_mix64(9, 1, 2, 1) & ((1 << 63) - 1))
    assert torch.equal(pe.pixel_ids(16, 8), torch.randperm(8, generator=g))
