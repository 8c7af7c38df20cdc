"""``dali-nerf make-scene objects|city|forward|unbounded``: multi-view scenes with known cameras,
rendered by us.

There is no internet and tests, the demo and the benchmarks need real, learnable, view-consistent
data, so we ray-cast ANALYTIC scenes (numpy, float64, vectorised over rays; no per-pixel Python):
exact first-hit intersection with spheres, yawed boxes, vertical cylinders and floor planes,
smooth procedural textures (soft checkers, stripes, window grids), Lambertian shading with one
directional light + ambient and hard shadows (one shadow ray per hit). Colour is view-independent.
One ray per pixel, through the pixel centre (+0.5), with the exact camera formula of
ARCHITECTURE.md -- so a perfect radiance field reproduces the images exactly (no anti-aliasing
blur to learn). Same seed -> same bytes (fixed PNG/JPEG encoder parameters, no timestamps).

Kinds:

``objects`` (the DDP workload) -- Blender synthetic format::

    out/transforms_{train,val,test}.json   camera_angle_x, near 2, far 6, aabb [-1.5,1.5]^3,
                                           frames: file_path "./train/r_0" (no extension for PNG,
                                           "./train/r_0.jpg" for JPEG), transform_matrix 4x4 c2w
    out/{train,val,test}/r_<i>.png         RGBA, alpha 0 where the ray hits nothing

  4-6 textured solids on a checkered floor disc, world up +z (like Blender), cameras at radius 4
  looking at the origin: train on a jittered golden-angle spiral over the upper hemisphere
  (elevation 15-75 deg), val random, test an orbit at 30 deg elevation. Defaults 160x160, 60/5/10.

``city`` (the spatial-segmentation workload) -- Mega-NeRF layout AND a nerfstudio transforms.json::

    out/coordinates.pt                     {'origin_drb': (3,) f32, 'pose_scale_factor': float,
                                            'near': float, 'far': float, 'aabb': (2,3) f32}
                                            (near/far/aabb in the normalised frame of the stored
                                            c2w; Mega-NeRF's own files have only the first two)
    out/{train,val}/rgbs/<global id>.png   RGBA (alpha 0 = sky; its RGB is white), ids unique
                                           across splits as Mega-NeRF expects
    out/{train,val}/metadata/<id>.pt       {'W': int, 'H': int, 'intrinsics': (4,) f32 fx fy cx cy,
                                            'c2w': (3,4) f32} -- plain tensors and ints only
                                            (torch.load(weights_only=True) works)
    out/transforms.json                    nerfstudio: shared fl_x fl_y cx cy w h, PINHOLE,
                                           frames (file_path -> the same rgbs), OpenGL c2w in
                                           the SCENE frame (below), train/val/test_filenames
                                           (test = val unless n_test > 0), near, far, aabb

  30-45 box buildings with window grids on a road grid, cameras on an oblique lawnmower grid
  (rows along x, heading alternating +x / -x, 30 deg off nadir), val cameras between the rows.
  Defaults 128x96, 48 train + 6 val.

``forward`` (real-capture stand-in: forward-facing) -- LLFF::

    out/poses_bounds.npy                   (N, 17): per view the 3x5 [down, right, back, position |
                                           (H, W, focal)] in the SCENE frame, then near, far
                                           (0.9 x the nearest and 1.1 x the farthest surface the
                                           view sees, distances along unit rays)
    out/images/image_<i>.jpg               full size, RGB (every pixel sees a surface: no alpha)
    out/images_4/, out/images_8/           exact 1/4 and 1/8 copies, area-averaged (INTER_AREA)

  8-11 textured solids 2.5-6 units ahead on a checkered floor before a textured back wall, seen by
  a small forward-facing array (rows x columns over 0.7 x 0.4 units). The parser holds out every
  8th view. Defaults 480x360 (multiples of 8), 20 views.

``unbounded`` (real-capture stand-in: cameras in the middle of a 360 scene) -- nerfstudio::

    out/transforms.json                    PINHOLE fl_x fl_y cx cy w h, frames (OpenGL c2w in the
                                           SCENE frame), train/val/test_filenames (test = val
                                           unless n_test > 0); no near, far, aabb or up, as
                                           COLMAP-made captures come
    out/images/frame_<id>.jpg              RGB, no alpha

  7-9 textured solids around the cameras on a floor disc, inside a textured environment sphere
  of radius 10; cameras on a ring of radius 0.35 looking outward. Defaults 160x120, 48 train + 6
  val.

Frames. ``render_scene_rays`` works in each kind's SCENE frame (forward, unbounded: z up, what
their files store):

* objects: the Blender world (z up) -- identical to what the json files store;
* city: z up, ground at z = 0, the city in [-1, 1]^2, cameras at altitude ~1 -- identical to
  transforms.json. Mega-NeRF's files are in its DRB world ("down, right, back": x down, y right,
  z back) in metres, recentred and scaled as Mega-NeRF stores them::

      p_drb_metres = CITY_METRES_PER_UNIT * DRB_FROM_SCENE @ p_scene + CITY_DRB_OFFSET
      p_stored     = (p_drb_metres - origin_drb) / pose_scale_factor

  and the columns of the stored c2w rotation are the OpenGL camera axes (right, up, back) in that
  DRB world, as Mega-NeRF's own ray code uses them (our parser's ``CAMERA_COLUMNS``).

Modules: :mod:`.tracer` (primitives, textures, shading: the analytic ray tracer), :mod:`.worlds`
(each kind's scene from its seed, :func:`render_scene_rays`), :mod:`.cameras` (poses, intrinsics,
defaults), :mod:`.writers` (the folder layouts above, :func:`make_scene`), :mod:`.cli`
(``dali-nerf make-scene``).

>>> from dali_nerf.scenegen import make_scene
>>> make_scene("objects", "data/default")                       # doctest: +SKIP
PosixPath('data/default')
"""

from dali_nerf.scenegen.cameras import BLENDER_CAMERA_ANGLE_X, DEFAULTS, KINDS, scene_cameras
from dali_nerf.scenegen.cli import main
from dali_nerf.scenegen.worlds import render_scene_rays
from dali_nerf.scenegen.writers import CITY_DRB_OFFSET, CITY_METRES_PER_UNIT, DRB_FROM_SCENE, make_scene

__all__ = [
    "make_scene", "render_scene_rays", "scene_cameras", "main", "KINDS", "DEFAULTS",
    "DRB_FROM_SCENE", "CITY_METRES_PER_UNIT", "CITY_DRB_OFFSET", "BLENDER_CAMERA_ANGLE_X",
]
