"""The one place that lazily imports DALI and loads our operator plugin (as nerfacc keeps its
lazy CUDA loading in one module).

``import dali_nerf`` (and every module that only *defines* pipelines or sources) stays free of
DALI and compilers; the first pipeline that is built calls :func:`dali_api` (the decode graph,
``pipelines/decode.py``) or :func:`ray_graph_api` (the ray graph, ``pipelines/rays.py``), which
switch DALI's host allocations to its pool (:func:`dali_nerf.data.hostmem.dali_host_pool`) before
importing DALI; the ray graph's also builds / loads the operator (:func:`dali_nerf.ops.load_plugin`).
"""

from __future__ import annotations

from dali_nerf.errors import SceneError
from dali_nerf.data.hostmem import dali_host_pool
from dali_nerf.ops import load_plugin

__all__ = ["dali_api", "ray_graph_api", "torch_feed"]


def dali_api():
    """``(fn, pipeline_def, types)`` of DALI, its host allocations pooled (:mod:`dali_nerf.data.hostmem`)."""
    dali_host_pool()  # before DALI's first host allocation
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError as e:  # pragma: no cover - dali is a dependency
        raise SceneError(f"nvidia-dali is not importable ({e}); pip install nvidia-dali-cuda120==2.4.0") from None
    return fn, pipeline_def, types


def ray_graph_api():
    """``(fn, pipeline_def, types)`` of DALI with ``fn.dali_nerf.ray_sampler`` loaded."""
    api = dali_api()
    load_plugin()
    return api


def torch_feed():
    """``(feed_ndarray, to_torch_type)`` of DALI's PyTorch plugin (GPU outputs -> torch)."""
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    return feed_ndarray, to_torch_type
