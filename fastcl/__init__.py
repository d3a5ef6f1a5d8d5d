"""fastcl: memory-lean contrastive objectives for sentence embeddings.

Functional API (torch.nn.functional style, all differentiable)::

    fastcl.infonce, fastcl.focal_infonce, fastcl.dclr_loss, fastcl.dclr_noise,
    fastcl.escl_loss, fastcl.alignment, fastcl.uniformity

Module wrappers: ``fastcl.InfoNCE``, ``fastcl.FocalInfoNCE``, ``fastcl.DCLRLoss``,
``fastcl.ESCLLoss``. The literal full-matrix oracle lives in ``fastcl.reference``.
"""

from . import reference
from ._validation import set_input_checks
from .functional import dclr_loss, dclr_noise, escl_loss, focal_infonce, infonce
from .metrics import alignment, uniformity
from .modules import DCLRLoss, ESCLLoss, FocalInfoNCE, InfoNCE

__version__ = "0.1.0"

__all__ = [
    "infonce", "focal_infonce", "dclr_loss", "dclr_noise", "escl_loss", "alignment",
    "uniformity", "InfoNCE", "FocalInfoNCE", "DCLRLoss", "ESCLLoss", "reference",
    "set_input_checks",
]
