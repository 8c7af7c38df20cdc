"""A DALI graph's run as torch tensors: :func:`run_graph` runs a ray graph once and reads
``consumed``, :func:`dali_to_torch` converts one output (zero copy on the CPU), :func:`step_views`
cuts a run into its steps' views. What the producers of :mod:`dali_nerf.sources.runner` build
their runs with.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dali_nerf.data._dali import torch_feed
from dali_nerf.pipelines.rays import GLOBAL_OUTPUTS, RAY_OUTPUTS

__all__ = ["dali_to_torch", "run_graph", "step_views"]


def dali_to_torch(tl, device: str, copy: bool = False) -> torch.Tensor:
    """One pipeline output (a batch of 1 sample) as a torch tensor on ``device``.

    CPU: a zero-copy view (DALI 2.4's asynchronous executor gives each run new buffers, kept alive
    while referenced); ``copy``: the synchronous executor (prefetch 0) reuses its output buffers
    on the next run, so the view is copied, by numpy: ``torch.Tensor.clone`` of a tensor over DALI's
    buffer cost ~7.5 ms per output on the 2-core AMD EPYC VM (2026-12-06: ``run_graph(copy=True)``
    of a 65536-ray run of the six outputs took 48 ms with ``clone``, 0.7 ms with ``np.array``,
    against 0.6 ms without a copy), which made a synchronous run ~80x its sampling. CUDA: a device-to-device copy into a torch tensor.
    """
    if device == "cuda":  # pragma: no cover - needs a GPU
        feed_ndarray, to_torch_type = torch_feed()
        t = tl[0] if hasattr(tl, "__getitem__") else tl.as_tensor()
        dst = torch.empty(tuple(t.shape()), dtype=to_torch_type[t.dtype], device="cuda")
        feed_ndarray(t, dst, cuda_stream=torch.cuda.current_stream())
        return dst
    a = np.asarray(tl[0])
    return torch.from_numpy(np.array(a) if copy else a)


def run_graph(pipe, device: str, keys: Sequence[str], copy: bool):
    """Run a ray graph (:func:`~dali_nerf.pipelines.rays.ray_pipeline`) once: ``(consumed,
    {key: tensor (R, ...)})`` for ``keys`` (a subset of ``RAY_OUTPUTS[:-1]``; a global-stream
    graph also ``step_counts`` (K,) and ``positions`` (R,)), ``consumed`` the stream positions the
    run used. ``copy``: see :func:`dali_to_torch`."""
    outs = pipe.run()
    out = dict(zip(GLOBAL_OUTPUTS if len(outs) == len(GLOBAL_OUTPUTS) else RAY_OUTPUTS, outs))
    consumed = out["consumed"].as_cpu() if device == "cuda" else out["consumed"]
    consumed = int(np.asarray(consumed[0]).reshape(-1)[0])
    return consumed, {k: dali_to_torch(out[k], device, copy) for k in keys}


def step_views(run: dict, steps: int, rays_per_batch: int) -> list:
    """The ``steps`` step batches of a run ``{key: (steps * B, ...)}`` as tuples of (B, ...) views
    in ``run``'s key order, made with one C++ call per output (``unbind``: ~0.6 us a view against
    ~3.7 us for a Python slice); a source hands out ``dict(zip(keys, views[i]))``."""
    return list(zip(*(v.view(steps, rays_per_batch, *v.shape[1:]).unbind(0) for v in run.values())))
