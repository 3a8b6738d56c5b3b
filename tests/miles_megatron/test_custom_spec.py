"""``--spec`` with a real spec (2 gloo ranks, the spawn test_layouts.py shares: conftest.py's
``two_rank_run``): the local spec with each layer's input norm swapped for an fp32-weight RMSNorm
(``mark_param_dtype``) builds the model from the HF checkpoint and trains a rollout under
``--bf16``; the norms stay fp32 in the model, in the distributed optimizer (fp32 parameters, no
master copy) and in the checkpoint, and the optimizer state resumes bit for bit (megatron-core
0.16's index map of mixed fp32/bf16 groups, fixed in ``mcore_compat``)."""

from __future__ import annotations

import pytest
from custom_spec_ranks import check_custom_spec


@pytest.mark.slow
def test_custom_spec_trains_and_keeps_marked_params_fp32(two_rank_run):
    check_custom_spec([rank["custom_spec"] for rank in two_rank_run])
