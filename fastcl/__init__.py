"""fastcl: memory-lean contrastive objectives for sentence embeddings.

Functional API (torch.nn.functional style, all differentiable)::

    fastcl.contrastive (every feature, composable), fastcl.infonce, fastcl.focal_infonce,
    fastcl.dclr_loss, fastcl.dclr_noise, fastcl.escl_loss, fastcl.alignment, fastcl.uniformity

Module wrappers: ``fastcl.InfoNCE``, ``fastcl.FocalInfoNCE``, ``fastcl.DCLRLoss``,
``fastcl.ESCLLoss``. The literal full-matrix oracle lives in ``fastcl.reference``.
"""

from . import layout
from ._validation import set_input_checks
from .functional import (contrastive, dclr_loss, dclr_noise, escl_loss, focal_infonce, infonce,
                         resolve_backend)
from .metrics import alignment, uniformity
from .modules import DCLRLoss, ESCLLoss, FocalInfoNCE, InfoNCE

__version__ = "0.2.0"

__all__ = [
    "contrastive", "infonce", "focal_infonce", "dclr_loss", "dclr_noise", "escl_loss", "alignment",
    "uniformity", "InfoNCE", "FocalInfoNCE", "DCLRLoss", "ESCLLoss", "set_input_checks",
    "resolve_backend", "layout",
]
