"""Fingerprints of the data path: what a restructuring must leave identical.

    python scripts/fingerprints.py                 # print them (JSON)
    python scripts/fingerprints.py --write FILE    # record them
    python scripts/fingerprints.py --check FILE    # compare with a record: exit 1 naming what differs

* ``streams``: SHA-256 of the batches the sources hand out, on small generated scenes:
  RayLoader (seed 0, ranks 0 and 1 of 2, random and epoch mode, the shard and the global stream;
  a streaming case; a resume from ``state_dict`` into a new loader), SpatialRayLoader for each cell of configs/ss_city.yaml's
  partition, and every baseline (DDP and SS). The operator's outputs are hashed whole (they are
  bit-exact on every x86-64 CPU: no FMA contraction, AVX2 equal to the scalar code); the torch
  baselines by their ``indices`` and ``rgb`` (which pixels, and their colours: the stream), since
  their float directions come from torch kernels that may round differently on another CPU.
* ``streams`` also hold the ImageLoader's batches (``images/...``: two ranks, patches, windows, a
  resume on another world size) on the objects scene written as a COLMAP folder.
* ``plans``: for every configs/*.yaml, each pipeline name its method offers (splat: its image
  loader, device cpu only), device cpu and
  emulated, at 1, 2 and 16 local ranks on 2 usable cores: the sampler threads, rays per run,
  thread priority, device (and workers) of the source(s) rank 0 gets (``LOCAL_WORLD_SIZE`` set;
  DDP sources are built for world size 1, which changes their shard, not their budget).

tests/test_fingerprints.py checks the record in tests/data/fingerprints.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
KIND_OF = {"ddp_objects": "objects", "ddp_blender_gpu": "objects", "study": "objects", "ddp_llff": "forward",
           "ddp_unbounded": "unbounded", "ss_city": "city", "splat_objects": "objects_colmap"}
B = 256
RUN = 1024


def _hash(batches, keys=None) -> str:
    h = hashlib.sha256()
    for b in batches:
        for k in sorted(b) if keys is None else keys:
            t = b[k].contiguous()
            h.update(k.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def _take(src, n):
    return [{k: v.clone() for k, v in next(src).items()} for _ in range(n)]


@contextlib.contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def scenes(root: Path) -> dict:
    from dali_nerf.scenegen import make_scene

    out = {}
    sizes = {"objects": dict(width=32, height=32, n_train=6, n_val=1, n_test=1),
             "city": dict(width=40, height=30, n_train=8, n_val=1, n_test=0),
             "forward": dict(width=64, height=48, n_train=8),
             "unbounded": dict(width=40, height=30, n_train=6, n_val=1, n_test=0)}
    for kind, kw in sizes.items():
        out[kind] = make_scene(kind, root / kind, seed=0, **kw)
    out["objects_colmap"] = make_scene("objects", root / "objects_colmap", seed=0, layout="colmap", **sizes["objects"])
    return out


def image_streams(dirs: dict) -> dict:
    """The ImageLoader's batches (every key hashed whole: uint8 images, exact float32 cameras) on the
    generated objects scene as a COLMAP folder: two ranks of one stream, patches, windows, a resume."""
    from dali_nerf.scenes import load_scene
    from dali_nerf.sources.images import ImageLoader

    scene = load_scene(dirs["objects_colmap"], split="train", format="colmap")
    out = {}
    kw = dict(seed=0, num_threads=1)
    for rank in (0, 1):
        with ImageLoader(scene, images_per_batch=2, rank=rank, world_size=2, **kw) as ld:
            out[f"images/rank{rank}of2"] = _hash(_take(ld, 5))
    with ImageLoader(scene, images_per_batch=3, patch_size=8, **kw) as ld:
        out["images/patch8"] = _hash(_take(ld, 4))
    with ImageLoader(scene, max_bytes=6 * 32 * 32 * 3, **kw) as ld:
        out["images/windows"] = _hash(_take(ld, 8))
        state = ld.state_dict()
    with ImageLoader(scene, images_per_batch=1, rank=1, world_size=3, **kw) as ld:
        ld.load_state_dict(state)
        out["images/resume/rank1of3"] = _hash(_take(ld, 4))
    return out


def streams(dirs: dict) -> dict:
    from dali_nerf import RayLoader, load_scene
    from dali_nerf.config import load_config
    from dali_nerf.partition import Partition, assign_rank
    from dali_nerf.sources import build_source
    from dali_nerf.sources.spatial import SpatialRayLoader

    out = {}
    scene = load_scene(dirs["objects"], split="train")
    kw = dict(rays_per_batch=B, seed=0, prefetch=2, num_threads=1, rays_per_run=RUN)
    for mode in ("random", "epoch"):
        for rank in (0, 1):
            with RayLoader(scene, rank=rank, world_size=2, mode=mode, **kw) as ld:
                out[f"rayloader/{mode}/rank{rank}of2"] = _hash(_take(ld, 8))
    for mode in ("random", "epoch"):  # the split's global stream (the trainers' default): each rank's part
        for rank in (0, 1):
            with RayLoader(scene, rank=rank, world_size=2, mode=mode, stream="global", **kw) as ld:
                out[f"rayloader/global/{mode}/rank{rank}of2"] = _hash(_take(ld, 8))
    px = int((scene.width * scene.height).max()) * 3
    with RayLoader(scene, rank=0, world_size=1, mode="random", max_bytes=3 * px, **kw) as ld:
        out["rayloader/streaming/random"] = _hash(_take(ld, 8))
    with RayLoader(scene, rank=0, world_size=1, mode="epoch", max_bytes=3 * px, **kw) as ld:
        out["rayloader/streaming/epoch"] = _hash(_take(ld, 8))
    with RayLoader(scene, rank=1, world_size=2, mode="epoch", **kw) as a:
        _take(a, 5)
        state = a.state_dict()
    with RayLoader(scene, rank=1, world_size=2, mode="epoch", **kw) as b:
        b.load_state_dict(state)
        out["rayloader/resume/epoch/rank1of2"] = _hash(_take(b, 4))

    ddp_cfg = load_config(REPO / "configs" / "ddp_objects.yaml", [f"scene.path={dirs['objects']}", "train.device=cpu",
                          f"pipeline.rays_per_batch={B}", f"pipeline.rays_per_run={RUN}", "pipeline.num_threads=1",
                          "pipeline.workers=1"])
    for name in ("sync_local", "sync_global", "torch_workers", "ready"):
        cfg = dataclasses.replace(ddp_cfg, pipeline=dataclasses.replace(ddp_cfg.pipeline, name=name))
        src = build_source(cfg, scene, 0, 1)
        try:
            out[f"ddp/{name}"] = _hash(_take(src, 4), ("indices", "rgb"))
        finally:
            src.close()

    ss_cfg = load_config(REPO / "configs" / "ss_city.yaml", [f"scene.path={dirs['city']}", "train.device=cpu",
                         f"pipeline.rays_per_batch={B}", f"pipeline.rays_per_run={RUN}", "pipeline.num_threads=1",
                         "pipeline.workers=1"])
    city = load_scene(dirs["city"], split="train", background=ss_cfg.scene.background)
    part = Partition.from_config(ss_cfg.partition, city)
    for cell in range(part.num_cells):
        with SpatialRayLoader(city, part, cell, rays_per_batch=B, seed=0, prefetch=2, num_threads=1,
                              rays_per_run=RUN) as ld:
            out[f"ss/rays/cell{cell}"] = _hash(_take(ld, 4))
    cells = assign_rank(part.num_cells, 1)
    for name in ("sync_local", "sync_global", "torch_workers", "ready"):
        cfg = dataclasses.replace(ss_cfg, pipeline=dataclasses.replace(ss_cfg.pipeline, name=name))
        srcs = build_source(cfg, city, 0, 1, cells=cells, partition=part)
        try:
            for slot, src in enumerate(srcs):
                out[f"ss/{name}/cell{cells[0][slot]}"] = _hash(_take(src, 3), ("indices", "rgb"))
        finally:
            for s in srcs:
                s.close()
    return out


def _describe(src) -> dict:
    d = {"type": type(src).__name__}
    for k in ("num_threads", "rays_per_run", "thread_priority", "device", "workers", "prefetch", "steps_per_run"):
        if hasattr(src, k):
            d[k] = getattr(src, k)
    return d


def plans(dirs: dict) -> dict:
    """Effective settings of the sources each config gives a rank (2 usable cores)."""
    from dali_nerf.config import load_config
    from dali_nerf.partition import Partition, assign_rank
    from dali_nerf.scenes import load_scene
    from dali_nerf.sources import build_source
    from dali_nerf.sources.registry import SOURCES, SS_SOURCES

    out = {}
    for path in CONFIGS:
        stem = path.stem
        base = load_config(path, [f"scene.path={dirs[KIND_OF[stem]]}"])
        sc = base.scene
        scene = load_scene(sc.path, split=sc.train_split, format=sc.format, downscale=sc.downscale,
                           background=sc.background)
        names = SS_SOURCES if base.method == "ss" else ("images",) if base.method == "splat" else SOURCES
        for device in ("cpu",) if base.method == "splat" else ("cpu", "emulated"):
            for local in (1, 2, 16):
                for name in names:
                    if name == "sync_global" and (device == "emulated" or local > 1):
                        continue  # emulated: its shared-memory scatter, not a source; > 1 rank: needs a process group
                    if base.method == "ss" and name != "rays" and base.pipeline.mode != "random":
                        continue
                    cfg = dataclasses.replace(base, pipeline=dataclasses.replace(base.pipeline, name=name),
                                              train=dataclasses.replace(base.train, device=device))
                    key = f"{stem}/{device}/local{local}/{name}"
                    job = {"TORCHELASTIC_RUN_ID": "fingerprints"} if cfg.method == "splat" else {}  # its node share's key
                    with _env(LOCAL_WORLD_SIZE=local, WORLD_SIZE=local, **job):
                        if cfg.method == "ss":
                            pc = cfg.partition
                            world = local if device == "cpu" else 1  # emulated: one process's view, all cells
                            if pc.kind == "grid" and pc.grid[0] * pc.grid[1] < world:  # a cell per rank at least
                                pc = dataclasses.replace(pc, grid=[4, 4])
                            part = Partition.from_config(pc, scene)
                            srcs = build_source(cfg, scene, 0, world, cells=assign_rank(part.num_cells, world),
                                                partition=part)
                        else:
                            srcs = [build_source(cfg, scene, 0, 1)]  # the budget follows LOCAL_WORLD_SIZE
                    try:
                        out[key] = [_describe(s) for s in srcs]
                    finally:
                        for s in srcs:
                            s.close()
    return out


def fingerprints(sections=("streams", "plans")) -> dict:
    try:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[:2])  # the plans are recorded for 2 usable cores
    except (AttributeError, OSError):
        cpus = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dirs = scenes(Path(tmp))
            out = {}
            if "streams" in sections:
                out["streams"] = streams(dirs) | image_streams(dirs)
            if "plans" in sections:
                out["plans"] = plans(dirs)
            return out
    finally:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)


def diff(want: dict, got: dict, prefix="") -> list:
    """Paths where ``got`` differs from ``want`` (only the sections ``got`` has)."""
    out = []
    for k in sorted(set(want) | set(got)):
        if not prefix and k not in got:
            continue
        a, b = want.get(k), got.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff(a, b, f"{prefix}{k}/")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(isinstance(x, dict) for x in a + b):
            # a plan: the recorded settings must be equal; a setting the sources newly report is not a change
            for i, (x, y) in enumerate(zip(a, b)):
                moved = {f: (x[f], y.get(f)) for f in x if x[f] != y.get(f)}
                if moved:
                    out.append(f"{prefix}{k}[{i}]: " + ", ".join(f"{f} recorded {r!r}, now {n!r}" for f, (r, n) in moved.items()))
        elif a != b:
            out.append(f"{prefix}{k}: recorded {a!r}, now {b!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    ap.add_argument("--sections", default="streams,plans")
    a = ap.parse_args(argv)
    got = fingerprints(tuple(a.sections.split(",")))
    if a.check:
        bad = diff(json.loads(Path(a.check).read_text()), got)
        for line in bad:
            print(line)
        print(f"{len(bad)} difference(s)" if bad else "identical")
        return 1 if bad else 0
    text = json.dumps(got, indent=1, sort_keys=True) + "\n"
    if a.write:
        Path(a.write).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
