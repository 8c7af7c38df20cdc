"""The batch sources' states refuse what they cannot continue: a state saved with another seed,
mode, rank, cell or batch is refused in one line naming the setting (a ConfigError, never a crash);
states written before a key existed (no ``epoch``, no ``global_batch``) still load."""

import pytest
import torch

from dali_nerf.config import PartitionConfig
from dali_nerf.errors import ConfigError
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.partition import Partition
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import load_scene
from dali_nerf.sources import RayLoader, SpatialRayLoader, SyncGlobalSampler, SyncLocalSampler

B = 32


@pytest.fixture(scope="module")
def city(tmp_path_factory):
    root = make_scene("city", tmp_path_factory.mktemp("st") / "city", width=16, height=12, n_train=6, n_val=1)
    scene = load_scene(root, "train", format="mega_nerf")
    return scene, decode_cache(scene, 0, 1)


def _refused(source, state, setting: str) -> str:
    with pytest.raises(ConfigError) as e:
        source.load_state_dict(state)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"load_state_dict: saved {setting}"), msg
    return msg


@pytest.mark.parametrize("cls", [SyncLocalSampler, SyncGlobalSampler])
def test_sync_samplers_refuse_another_seed_mode_or_batch(city, cls):
    scene, _ = city
    src = cls(scene, rays_per_batch=B, seed=3, num_threads=1)
    next(src)
    state = src.state_dict()
    assert {"position", "epoch", "mode", "seed", "rank", "world_size", "rays_per_batch"} <= set(state)
    assert state["position"] == B and state["seed"] == 3 and state["mode"] == "random"
    assert _refused(cls(scene, rays_per_batch=B, seed=4, num_threads=1), state, "seed=3") \
        .endswith("but this sampler has 4; resume with the same settings")
    _refused(cls(scene, rays_per_batch=B, seed=3, mode="epoch", num_threads=1), state, "mode='random'")
    if cls is SyncLocalSampler:  # a rank's own stream: rank and world size are part of it
        _refused(cls(scene, rays_per_batch=B, seed=3, num_threads=1), dict(state, rank=1), "rank=1")
        _refused(cls(scene, rays_per_batch=B, seed=3, num_threads=1), dict(state, world_size=2), "world_size=2")
        _refused(cls(scene, rays_per_batch=2 * B, seed=3, num_threads=1), state, f"rays_per_batch={B}")
    same = cls(scene, rays_per_batch=B, seed=3, num_threads=1)
    same.load_state_dict({k: v for k, v in state.items() if k != "epoch"})  # before epochs were saved
    assert same.position == B and same.epoch == 0
    for s in (src, same):
        s.close()


def test_sync_global_reads_the_global_batch_of_a_state_without_one(city):
    """A sync_global state saved before ``global_batch`` was recorded: G = its rays_per_batch x
    world_size (here 2 x 16 rays), so it continues on one rank with B = 32 and is refused with 16."""
    scene, _ = city
    src = SyncGlobalSampler(scene, rays_per_batch=B, seed=1, num_threads=1)
    old = {k: v for k, v in src.state_dict().items() if k not in ("global_batch", "stream")}
    old.update(rays_per_batch=B // 2, world_size=2, position=5 * B)
    src.load_state_dict(old)
    assert src.position == 5 * B
    half = SyncGlobalSampler(scene, rays_per_batch=B // 2, seed=1, num_threads=1)
    with pytest.raises(ConfigError, match=rf"^load_state_dict: saved global batch {B} \(rays_per_batch x world_size\) "
                                          rf"but this sampler has {B // 2}; use rays_per_batch = {B} / world_size$"):
        half.load_state_dict(old)
    with pytest.raises(ConfigError, match=rf"saved global batch {B} "):
        half.load_state_dict(src.state_dict())
    for s in (src, half):
        s.close()


def test_spatial_loader_refuses_another_cell_seed_mode_or_batch(city):
    scene, cache = city
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), scene)

    def loader(cell=1, **kw):
        return SpatialRayLoader(scene, part, cell, **{"rays_per_batch": B, "rays_per_run": 2 * B, "cache": cache,
                                                      "seed": 2, **kw})

    with loader() as L:
        next(L)
        state = L.state_dict()
    assert state["rays_per_batch"] == B and state["seed"] == 2 and state["cell"] == 1 and state["offset"] == B
    for kw, setting in (({"cell": 0}, "cell=1"), ({"seed": 5}, "seed=2"), ({"mode": "epoch"}, "mode='random'"),
                        ({"rays_per_batch": 2 * B}, f"rays_per_batch={B}")):
        with loader(**kw) as other:
            msg = _refused(other, state, setting)
            assert msg.endswith(f"but this loader has {getattr(other, setting.split('=')[0])!r}"), msg


def test_rayloader_state_without_an_epoch_loads_at_epoch_zero(city):
    scene, cache = city
    with RayLoader(scene, rays_per_batch=B, rays_per_run=2 * B, cache=cache, num_threads=1, mode="epoch") as L:
        L.set_epoch(2)
        next(L)
        state = L.state_dict()
    assert state["epoch"] == 2
    with RayLoader(scene, rays_per_batch=B, rays_per_run=2 * B, cache=cache, num_threads=1, mode="epoch") as R:
        R.load_state_dict({k: v for k, v in state.items() if k != "epoch"})
        assert R.epoch == 0 and R.position == state["position"]
        b = next(R)
        assert set(b) >= {"origins", "directions", "rgb"} and b["rgb"].shape[0] == B and torch.isfinite(b["rgb"]).all()


def test_rayloader_shard_state_is_refused_on_another_rank(city):
    """A shard-stream state is its rank's stream: rank 1 of 2 refuses rank 0's (naming the rank),
    and the state says which rank wrote it."""
    scene, _ = city
    kw = {"rays_per_batch": B, "rays_per_run": 2 * B, "num_threads": 1, "stream": "shard", "world_size": 2}
    with RayLoader(scene, rank=0, cache=decode_cache(scene, 0, 2), **kw) as L:
        next(L)
        state = L.state_dict()
    assert state["rank"] == 0 and state["world_size"] == 2 and state["stream"].startswith("shard")
    with RayLoader(scene, rank=1, cache=decode_cache(scene, 1, 2), **kw) as other:
        assert _refused(other, state, "rank=0").endswith("but this loader has 1; resume with the same settings")
