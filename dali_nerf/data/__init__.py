"""The data path's core between a scene and a DALI graph: the sampling plan (``plan``, resolved once
per rank, with the host budget of ``hostbudget`` and every stream key of ``seeds``) and the image
cache (``imagecache``: the one place that decodes, ``finish``: per-image finishing, ``imageio``:
header checks, ``hostmem``: page-locked host memory); ``rays`` is the torch ray formula the op's
CPU/CUDA code mirrors, ``_dali`` the one lazy import of DALI and the operator."""
