"""The one launch of Chapter 14's page: every check and DeepSpeed's layer together.

Taught in: Chapter 14, mixture of experts.
"""

from __future__ import annotations

from typing import Any

from dtlib.chapters.ch14_experts.deepspeed_moe import deepspeed_moe_check
from dtlib.chapters.ch14_experts.runs import ep_checks
from dtlib.expert_parallel import MoEConfig
from dtlib.models.gpt import GPTConfig


def page_run(cfg: GPTConfig, moe: MoEConfig, batch: int, steps: int,
             deepspeed_cfgs: list[MoEConfig]) -> dict[str, Any]:
    """One rank of the page's one launch (4 ranks): :func:`~.runs.ep_checks` with
    ep 2 x dp 2, and DeepSpeed's MoE layer on the same tokens
    (:func:`~.deepspeed_moe.deepspeed_moe_check`)."""
    out = ep_checks(cfg, moe, batch, steps, (2, 2))
    out["deepspeed"] = deepspeed_moe_check(deepspeed_cfgs)
    return out
