"""Patching the Triton attention kernels' tiles in a test, with the plans kept apart.

A plan (ops/attention/plans.py) keeps the launch template made at its first call, tiles
included, and serves every later call of the same metadata. A test that patches
`attention_config` after a call of the same metadata would reuse that plan and never run the
patched tiles (the pipelined loop's equality test compared the plain loop with itself that
way); a plan made under the patch would serve later tests with the patched tiles. So the
patch comes with an empty plan cache of its own, and the old one is back when it is undone.
"""

from __future__ import annotations

from fusedattn.ops.attention import plans
from fusedattn.triton_kernels import attention as K


def patch_attention_config(monkeypatch, transform) -> None:
    """Every attention_config(...) from here on returns transform(cfg, *args, **kwargs) of
    what it returned before, in calls that make their own plans."""
    original = K.attention_config

    def patched(*args, **kwargs):
        return transform(original(*args, **kwargs), *args, **kwargs)

    monkeypatch.setattr(K, "attention_config", patched)
    monkeypatch.setattr(plans.PLANS, "plans", {})
