"""The one place that lazily imports DALI and loads our operator plugin (as nerfacc keeps its
lazy CUDA loading in one module).

``import dali_nerf`` (and every module that only *defines* pipelines or sources) stays free of
DALI and compilers; the first pipeline that is built calls :func:`ray_graph_api`, which imports
DALI, switches DALI's host allocations to its pool (:func:`dali_nerf.hostmem.dali_host_pool`) and
builds / loads the operator (:func:`dali_nerf.ops.load_plugin`). The decode graph
(``pipelines/decode.py``) imports DALI through its own ``_import_dali`` for the same reason.
"""

from __future__ import annotations

from dali_nerf.hostmem import dali_host_pool
from dali_nerf.ops import load_plugin

__all__ = ["ray_graph_api", "torch_feed"]


def ray_graph_api():
    """``(fn, pipeline_def, types)`` of DALI with ``fn.dali_nerf.ray_sampler`` loaded."""
    from nvidia.dali import fn, pipeline_def, types

    dali_host_pool()  # per-run output buffers from DALI's pool (dali_nerf.hostmem)
    load_plugin()
    return fn, pipeline_def, types


def torch_feed():
    """``(feed_ndarray, to_torch_type)`` of DALI's PyTorch plugin (GPU outputs -> torch)."""
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    return feed_ndarray, to_torch_type
