"""Questions of the long-runs chapter: checkpoints, resharding, failures and the token loss
(notebook 09_long_runs).

``numbers`` (the bytes one rank writes to a checkpoint, the Young/Daly checkpoint
interval), ``reshard`` (which ranges of which saved rank a new rank reads, for a flat
vector split by torch.chunk's rule, on uneven sizes) and ``token_loss`` (the loss that no
layout moves: normalised by the real tokens of every microbatch of every rank, run on
ranks and sub-groups with padding that differs across ranks and microbatches) and
``zero1_checkpoint`` (Zero1's optimizer state described to DCP, saved on one number of
ranks and resumed on another).
"""

from __future__ import annotations

from parlib.course.questions.ch09 import numbers, reshard, token_loss, zero1_checkpoint
from parlib.course.questions.ch09.reshard import RESHARD_SOLUTION
from parlib.course.questions.ch09.token_loss import TOKEN_LOSS_SOLUTION
from parlib.course.questions.ch09.zero1_checkpoint import ZERO1_STATE_SOLUTION

__all__ = ["RESHARD_SOLUTION", "TOKEN_LOSS_SOLUTION", "ZERO1_STATE_SOLUTION", "numbers",
           "reshard", "token_loss", "zero1_checkpoint"]
