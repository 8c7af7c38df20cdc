"""Per-image finishing of decoded images: composite over the background -> undistort -> area
downscale, on the host (:func:`finish_image`, numpy / OpenCV) or on the image's device
(:func:`finish_torch`, the GPU decode path; tested on the CPU), with the same bytes.

Image policy: RGBA is composited over the background exactly, in integers, as
``round((rgb * a + bg8 * (255 - a)) / 255)`` with ``bg8 = round(255 * bg)``; grayscale is expanded
to RGB. Then, at the file's size, a distorted camera (``Scene.distortion``) is undistorted
(:func:`undistort_maps`, ``cv2.remap`` bilinear) to the pinhole camera ``Scene.intrinsics``; then an
image declared smaller than its file (``downscale`` without a pre-downscaled copy) is area-averaged
to its declared size (``cv2.INTER_AREA``: the exact block mean for an integer ratio,
area-weighted for a non-integer one, :func:`area_weights`).

>>> out = np.empty((h, w, 3), np.uint8); finish_image(rgba, (1.0, 1.0, 1.0), out)
"""

from __future__ import annotations

from typing import Optional

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from dali_nerf.errors import DataError
from dali_nerf.scenes._util import opencv_matrix

__all__ = ["background_u8", "composite", "area_weights", "undistort_maps", "finish_image", "finish_gpu",
           "finish_torch"]


def background_u8(background) -> np.ndarray:
    """(3,) uint8 ``round(255 * bg)`` of a background in [0, 1]."""
    return np.clip(np.round(np.asarray(background, np.float64) * 255.0), 0, 255).astype(np.uint8)


def composite(img: np.ndarray, background, out: Optional[np.ndarray] = None) -> np.ndarray:
    """(H, W, C) uint8 with C in {1, 2, 3, 4} -> (H, W, 3) uint8 RGB over ``background`` (3,) in [0, 1].

    1 = gray, 2 = gray + alpha, 3 = RGB, 4 = RGBA; alpha composited exactly in integers as
    ``round((rgb * a + bg8 * (255 - a)) / 255)`` with ``bg8 = round(255 * bg)``. Writes into ``out``.
    """
    c = img.shape[2]
    h, w = img.shape[:2]
    if out is None:
        out = np.empty((h, w, 3), np.uint8)
    if c in (1, 2):
        rgb = np.broadcast_to(img[:, :, :1], (h, w, 3))
    elif c in (3, 4):
        rgb = img[:, :, :3]
    else:
        raise DataError(f"image with {c} channels: expected gray, gray+alpha, RGB or RGBA")
    if c in (2, 4):
        # exact integer compositing with cv2 (SIMD, threaded): uint16 rgb*a + bg8*(255-a) <= 65025,
        # then convertScaleAbs rounds x/255 (never a tie for integers)
        a = img[:, :, c - 1]
        a3 = cv2.merge([a, a, a])
        v = cv2.multiply(np.ascontiguousarray(rgb), a3, dtype=cv2.CV_16U)
        bg8 = background_u8(background)
        w = cv2.multiply(cv2.bitwise_not(a3), (float(bg8[0]), float(bg8[1]), float(bg8[2]), 0.0), dtype=cv2.CV_16U)
        cv2.add(v, w, dst=v)
        if out.flags.c_contiguous:
            cv2.convertScaleAbs(v, dst=out, alpha=1.0 / 255.0)
        else:
            out[...] = cv2.convertScaleAbs(v, alpha=1.0 / 255.0)
    else:
        out[...] = rgb
    return out


def area_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) float64 area-averaging weights (``cv2.INTER_AREA``'s definition for
    downscaling): output pixel j averages the input interval ``[j * s, (j + 1) * s)``,
    ``s = n_in / n_out``, each input pixel weighted by its overlap with it. For an integer ``s``
    each row is ``s`` weights of ``1 / s`` (the block mean); otherwise pixels straddling an
    interval's edge count fractionally. Rows sum to 1.

    >>> area_weights(4, 2)
    array([[0.5, 0.5, 0. , 0. ],
           [0. , 0. , 0.5, 0.5]])
    """
    if not 0 < n_out <= n_in:
        raise ValueError(f"area_weights: need 0 < n_out <= n_in, got {n_in} -> {n_out}")
    edges = np.arange(n_out + 1, dtype=np.float64) * n_in / n_out
    i = np.arange(n_in, dtype=np.float64)[None, :]
    w = np.clip(np.minimum(edges[1:, None], i + 1) - np.maximum(edges[:-1, None], i), 0.0, None)
    return w / w.sum(axis=1, keepdims=True)


def undistort_maps(scene, cam: int):
    """(map_x, map_y), each (fh, fw) float32: for each pixel of the undistorted image of camera
    ``cam`` (at the file size ``scene.file_wh[cam]``, intrinsics ``scene.intrinsics[cam]`` scaled
    back to that size) the position in the distorted file image, from
    ``cv2.initUndistortRectifyMap`` / ``cv2.fisheye.initUndistortRectifyMap`` with the file's
    camera ``scene.file_intrinsics[cam]`` and ``scene.distortion[cam]``."""
    fw, fh = (int(v) for v in scene.file_wh[cam])
    w, h = int(scene.width[cam]), int(scene.height[cam])
    sx, sy = fw / w, fh / h  # scale_intrinsics back to the file's size
    k_new = np.asarray(scene.intrinsics[cam], np.float64) * np.array([sx, sy, sx, sy])
    # OpenCV's pixel centres are at integers, ours at +0.5 (opencv_matrix shifts the principal point)
    k_src, k_dst = opencv_matrix(scene.file_intrinsics[cam]), opencv_matrix(k_new)
    dist = np.asarray(scene.distortion[cam], np.float64)
    if scene.fisheye[cam]:
        return cv2.fisheye.initUndistortRectifyMap(k_src, dist[:4].reshape(4, 1), np.eye(3), k_dst, (fw, fh), cv2.CV_32FC1)
    return cv2.initUndistortRectifyMap(k_src, dist, np.eye(3), k_dst, (fw, fh), cv2.CV_32FC1)


def finish_image(img: np.ndarray, background, out: np.ndarray, maps=None) -> np.ndarray:
    """One decoded image (fh, fw, C) uint8 -> ``out`` (h, w, 3) uint8, the cache's image:

    1. :func:`composite` over ``background`` (alpha images; gray -> RGB), at the file's size;
    2. undistort with ``maps`` (:func:`undistort_maps`): ``cv2.remap``, bilinear, border
       replicated (the alpha = 0 intrinsics keep the maps inside the image; replication only
       covers the last sub-pixel);
    3. area downscale to (w, h) when the sizes differ: ``cv2.INTER_AREA`` (an integer factor is
       the exact block mean, rounded; otherwise :func:`area_weights`).

    Composite first, then resample: averaging composited colours is what a camera in front of
    the background would see (averaging straight RGBA would not be).
    """
    h, w = out.shape[:2]
    same = img.shape[0] == h and img.shape[1] == w
    if maps is None and same:
        if img.shape[2] == 3:  # RGB (every colour JPEG): one contiguous copy into the cache
            np.copyto(out, img)
        else:
            composite(img, background, out=out)
        return out
    rgb = img if img.shape[2] == 3 else composite(img, background)
    if maps is not None:
        rgb = cv2.remap(rgb, maps[0], maps[1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    if same:
        np.copyto(out, rgb)
    else:
        out[...] = cv2.resize(rgb, (w, h), interpolation=cv2.INTER_AREA)
    return out


def finish_gpu(tensor_gpu, bg255, out, maps, aux: dict):  # pragma: no cover - needs a GPU
    """:func:`finish_torch` of one decoded DALI TensorGPU (fh, fw, C) into ``out`` (h, w, 3) uint8 CUDA."""
    img = torch.as_tensor(tensor_gpu, device="cuda")  # __cuda_array_interface__, no host copy
    finish_torch(img, bg255, out, maps, aux)
    torch.cuda.current_stream().synchronize()  # DALI may reuse the decode buffer on the next run


def finish_torch(img, bg255, out, maps=None, aux: Optional[dict] = None):
    """:func:`finish_image` in torch, on ``img``'s device (the GPU decode path; tested on the CPU).

    Args:
        img: (fh, fw, C) uint8 tensor, C in {1, 2, 3, 4}.
        bg255: (3,) int32 tensor ``round(255 * background)`` on the same device.
        out: (h, w, 3) uint8 tensor, written.
        maps: None or :func:`undistort_maps`' (map_x, map_y) numpy arrays.
        aux: dict caching the device copies of the maps (as grids) and the area weights.

    Composite in integers (the same bytes as :func:`composite`); undistort with
    ``grid_sample`` (bilinear, border) on the same maps; area downscale: ``avg_pool2d`` (the
    block mean) for an integer ratio, else ``Wy @ img @ Wx^T`` with :func:`area_weights` in
    float64; rounded. Equal to the CPU path without resampling; within 1 LSB of it (cv2's
    fixed-point rounding) otherwise.
    """
    aux = {} if aux is None else aux
    dev = img.device
    fh, fw, c = img.shape
    h, w = out.shape[:2]
    rgb = img[:, :, :1].expand(-1, -1, 3) if c in (1, 2) else img[:, :, :3]
    if c in (2, 4):
        a = img[:, :, c - 1:c].to(torch.int32)
        rgb = ((rgb.to(torch.int32) - bg255) * a + bg255 * 255 + 127) // 255
    if maps is None and (fh, fw) == (h, w):
        out.copy_(rgb.to(torch.uint8))
        return out
    x = rgb.to(torch.float32).permute(2, 0, 1)  # (3, fh, fw)
    if maps is not None:
        key = ("grid", id(maps[0]))
        if key not in aux:
            gx = (torch.as_tensor(maps[0], device=dev) + 0.5) * (2.0 / fw) - 1.0
            gy = (torch.as_tensor(maps[1], device=dev) + 0.5) * (2.0 / fh) - 1.0
            aux[key] = (maps, torch.stack([gx, gy], -1)[None])  # keeps maps alive: the id stays unique
        x = F.grid_sample(x[None], aux[key][1], mode="bilinear", padding_mode="border", align_corners=False)[0]
    if (fh, fw) != (h, w):
        if fh % h == 0 and fw % w == 0:  # integer ratio: the block mean, no matmul (TF32 cannot touch it)
            x = F.avg_pool2d(x[None], (fh // h, fw // w))[0]
        else:  # exact area weights, float64 so that TF32 matmul settings do not apply
            for n_in, n_out in ((fh, h), (fw, w)):
                if ("area", n_in, n_out) not in aux:
                    aux[("area", n_in, n_out)] = torch.as_tensor(area_weights(n_in, n_out), device=dev)
            x = (aux[("area", fh, h)] @ x.double() @ aux[("area", fw, w)].T).float()
    out.copy_(x.round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0))
    return out
