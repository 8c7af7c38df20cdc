"""Optimiser and learning-rate schedule for the fields in this package.

Adam (betas 0.9, 0.99, eps 1e-15 as in instant-NGP / TensoRF) with one learning rate
``TrainConfig.lr`` for the factorised grids and ``lr * mlp_lr_scale`` for the MLP (weight decay
only on the MLP), and an exponential decay to ``final_lr_ratio`` of the start over the run.

Example:
    >>> opt, sched = make_optimizer(field, cfg)    # cfg: the whole Config
    >>> loss.backward(); opt.step(); sched.step()  # once per step
"""

from __future__ import annotations

import torch

__all__ = ["make_optimizer", "lr_lambda"]

FINAL_LR_RATIO = 0.1
MLP_LR_SCALE = 0.1


def lr_lambda(step: int, total_steps: int, final_ratio: float = FINAL_LR_RATIO) -> float:
    """Multiplier of the base lr after ``step`` of ``total_steps``: final_ratio ** (step / total)."""
    return final_ratio ** (min(max(step, 0), total_steps) / max(total_steps, 1))


def make_optimizer(field: torch.nn.Module, cfg, total_steps: int = None):
    """(Adam, LambdaLR) for ``field`` from ``cfg.train`` (lr, weight_decay, steps).

    Parameters whose name contains ``_vm.`` (the grids) get ``lr``; the rest (MLP) get
    ``lr * MLP_LR_SCALE`` and ``weight_decay``. Step the scheduler once per optimiser step.
    """
    lr = float(cfg.train.lr)
    wd = float(cfg.train.weight_decay)
    total = int(total_steps if total_steps is not None else cfg.train.steps)
    grids, mlp = [], []
    for name, p in field.named_parameters():
        (grids if "_vm." in name else mlp).append(p)
    groups = [{"params": grids, "lr": lr, "weight_decay": 0.0}]
    if mlp:
        groups.append({"params": mlp, "lr": lr * MLP_LR_SCALE, "weight_decay": wd})
    opt = torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.99), eps=1e-15)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total))
    return opt, sched
