"""Radiance field (TensoRF-VM grid + tiny MLP), occupancy grid, volume renderer, image metrics.

See docs/MODEL.md for the choice and its measurements.
"""

from dali_nerf.models.field import RadianceField, TensorVMField, build_field
from dali_nerf.models.metrics import mse, psnr, ssim
from dali_nerf.models.occupancy import OccupancyGrid, build_occupancy
from dali_nerf.models.optim import lr_lambda, make_optimizer
from dali_nerf.models.render import ray_aabb, render_image, render_rays
from dali_nerf.models.space import contract, lin_disp_samples, ndc_rays, ndc_to_world, normalize_to_box, uncontract, world_to_ndc

__all__ = [
    "RadianceField", "TensorVMField", "build_field", "OccupancyGrid", "build_occupancy",
    "render_rays", "render_image", "ray_aabb", "psnr", "ssim", "mse", "make_optimizer", "lr_lambda",
    "ndc_rays", "world_to_ndc", "ndc_to_world", "contract", "uncontract", "normalize_to_box", "lin_disp_samples",
]
