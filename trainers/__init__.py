"""torchrun entry points (installed as ``dali_nerf.trainers``); ``dali-nerf train`` starts the one
its config's ``method:`` names (dali_nerf/cli/train.py):

    torchrun --nproc_per_node=N trainers/ddp.py --config configs/ddp_objects.yaml
    torchrun --nproc_per_node=N -m dali_nerf.trainers.spatial --config ss_city

Both are thin method definitions over the one loop in :mod:`dali_nerf.train.loop`.
"""

__all__ = ["ddp", "spatial"]
