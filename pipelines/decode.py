"""The decode graph: DALI ``readers.file`` (sharded like DALI shards) + ``decoders.image``.

This module holds the graph only; decoding a rank's images into the cache the ray sampler reads
(finishing each image, packing, the checks) is :mod:`dali_nerf.data.imagecache`'s.

Sharding is DALI's own: shard ``i`` of ``S`` over ``N`` files is the index range
``[floor(i * N / S), floor((i + 1) * N / S))`` (:func:`shard_range`), read with ``pad_last_batch``
(padded duplicates are dropped by label).

>>> pipe = decode_pipeline(scene.image_paths, range(scene.num_images), shard_id=0, num_shards=2)
>>> images, labels = pipe.run()
"""

from __future__ import annotations

import numpy as np

from dali_nerf.data._dali import dali_api
from dali_nerf.errors import SceneError
from dali_nerf.ops.limits import shard_range  # DALI's shard rule (re-exported)

__all__ = ["decode_pipeline", "shard_range", "shard_sizes", "check_shard"]


def check_shard(scene, rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise SceneError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
    if world_size > scene.num_images:
        raise SceneError(
            f"{scene.root}: split {scene.split!r} has {scene.num_images} images but world_size={world_size}; "
            f"use at most {scene.num_images} ranks or a scene with more images"
        )


def shard_sizes(scene, world_size: int, sizes=None) -> np.ndarray:
    """Pixels per rank's shard, (world_size,) int64, without decoding anything (``sizes``: (N,)
    per-image counts to sum instead of width x height, e.g. a masked scene's valid pixels)."""
    check_shard(scene, 0, world_size)
    px = (scene.width * scene.height).astype(np.int64) if sizes is None else np.asarray(sizes, np.int64)
    out = np.zeros(world_size, np.int64)
    for r in range(world_size):
        a, b = shard_range(scene.num_images, r, world_size)
        out[r] = px[a:b].sum()
    return out


def decode_pipeline(files, labels, shard_id, num_shards, *, device="cpu",
                    batch_size=8, num_threads=2, device_id=None, prefetch_queue_depth=2):
    """Build (not run) the decode pipeline: ``readers.file`` (sharded, named "Reader",
    ``pad_last_batch``) -> ``decoders.image`` (ANY_DATA keeps alpha / gray). Images come out at
    the files' own size; compositing, undistortion and the area downscale follow per image in
    :func:`dali_nerf.data.imagecache.decode_cache` (``fn.resize``'s interpolation types, NN / linear / cubic / Lanczos3 /
    triangular / Gaussian, include no documented exact area mean).

    Args:
        files: (N,) image paths of the split; labels: (N,) camera index in the split.
        shard_id, num_shards: DALI sharding (the rank and world size).
        device: "cpu" or "mixed" (nvJPEG; outputs on the GPU).
    Returns:
        A built DALI pipeline whose outputs are (images (H, W, C) uint8, labels (1,) int32).
    """
    fn, pipeline_def, types = dali_api()

    @pipeline_def
    def _decode():
        data, lab = fn.readers.file(
            files=list(files), labels=[int(x) for x in labels], shard_id=shard_id, num_shards=num_shards,
            pad_last_batch=True, name="Reader", random_shuffle=False,
        )
        # pixels as stored (EXIF orientation ignored): the size the header and the scene declare
        img = fn.decoders.image(data, device=device, output_type=types.ANY_DATA, adjust_orientation=False)
        return img, lab

    pipe = _decode(batch_size=batch_size, num_threads=num_threads,
                   device_id=device_id, prefetch_queue_depth=prefetch_queue_depth)
    pipe.build()
    return pipe
