"""Training: the MTP objective, weight schedules, trainer (pretrain / heads / finetune), evaluation, heal."""

from .loss import mtp_weights, shifted_cross_entropy

__all__ = ["mtp_weights", "shifted_cross_entropy"]
