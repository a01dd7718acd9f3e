"""Expert routing: router logits -> (top-k weights, top-k expert ids).

Every function returns ``topk_weights [T, K] float32`` and ``topk_ids [T, K] int64``
(global expert ids). Scores are computed in float32 whatever the logits' dtype, as
transformers does, so a bf16 model routes the same tokens to the same experts.

``Routing`` is a model's routing rule; ``route`` applies it: plain softmax top-k
(Mixtral, Qwen-MoE, OLMoE) or, for anything else (sigmoid scores, a score-correction bias,
group-limited choice, a scaling factor: GLM-4.5, DeepSeek-V3), ``grouped_topk``. The fast
router paths compute only the plain rule: the C++ router on bias-free logits
(``Routing.plain_softmax`` keeps it off the others), the Triton one on CUDA on the logits
once a router bias is added (``Routing.softmax_of_logits``).
A router bias (GPT-OSS) is added to the logits before ``route`` (``FusedMoE.route``); its
softmax over the top-k logits is softmax top-k renormalised, the same weights.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import assert_never

import torch
from torch import Tensor


class Scoring(enum.Enum):
    SOFTMAX = "softmax"  # over all experts
    SIGMOID = "sigmoid"  # each expert on its own


@dataclass(frozen=True)
class Routing:
    """A model's routing rule (see ``grouped_topk`` for the group-limited fields)."""

    top_k: int
    renormalize: bool  # divide the k weights by their sum
    scoring: Scoring = Scoring.SOFTMAX
    num_groups: int = 1  # experts split into this many equal groups ...
    topk_group: int = 1  # ... of which each token keeps its best this many
    correction_bias: bool = False  # an [E] bias added to the scores for choosing only
    scaling_factor: float = 1.0  # multiplies the final weights
    router_bias: bool = False  # the gate has an [E] bias on its logits (GPT-OSS)

    @functools.cached_property  # read by every MoE layer every step
    def softmax_of_logits(self) -> bool:
        """Softmax top-k of the logits (a router bias already added), optionally
        renormalised: what the Triton router (``tidal/kernels/topk_softmax.py``) computes."""
        return (
            self.scoring is Scoring.SOFTMAX
            and self.topk_group >= self.num_groups
            and not self.correction_bias
            and self.scaling_factor == 1.0
        )

    @functools.cached_property
    def plain_softmax(self) -> bool:
        """Softmax top-k, optionally renormalised, of bias-free logits: what every fast
        CPU router path computes (they compute the logits too, without a bias)."""
        return self.softmax_of_logits and not self.router_bias


def route(
    router_logits: Tensor,  # [T, E] any float dtype
    routing: Routing,
    correction_bias: Tensor | None = None,  # [E] float32, when routing.correction_bias
) -> tuple[Tensor, Tensor]:  # ([T, K] float32, [T, K] int64)
    """Apply ``routing`` to the logits: the torch implementation of every rule."""
    if routing.correction_bias != (correction_bias is not None):
        raise ValueError("a correction bias must be given exactly when the routing has one")
    if routing.plain_softmax:
        return softmax_topk(router_logits, routing.top_k, routing.renormalize)
    return grouped_topk(
        router_logits, routing.top_k, routing.renormalize, routing.num_groups,
        routing.topk_group, routing.scoring, correction_bias, routing.scaling_factor,
    )  # fmt: skip


def softmax_topk(
    router_logits: Tensor,  # [T, E] any float dtype
    top_k: int,
    renormalize: bool,
) -> tuple[Tensor, Tensor]:  # ([T, K] float32, [T, K] int64)
    """Softmax over all experts (float32), keep the top-k, optionally renormalise.

    ``renormalize=True`` is Mixtral and Qwen3-MoE with ``norm_topk_prob``; False keeps
    the raw softmax probabilities (Qwen3-MoE default).
    """
    _check_top_k(router_logits, top_k)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def grouped_topk(
    router_logits: Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring: Scoring = Scoring.SOFTMAX,
    e_score_correction_bias: Tensor | None = None,  # [E] float: used for choosing only
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:  # ([T, K] float32, [T, K] int64)
    """DeepSeek-style group-limited routing.

    Experts are split into ``num_expert_group`` equal groups; each token keeps its best
    ``topk_group`` groups and picks its ``top_k`` experts inside them. A group's score is
    its best expert score, or (with a correction bias, as in DeepSeek-V3) the sum of its
    two best biased scores. The bias only steers the choice: the returned weights are the
    unbiased scores of the chosen experts (renormalised, then scaled by
    ``routed_scaling_factor``), as transformers' Glm4Moe and DeepSeek-V3 routers compute.
    """
    _check_top_k(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(
            f"num_expert_group ({num_expert_group}) must divide the number of experts ({num_experts})"
        )
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be in [1, {num_expert_group}], got {topk_group}")
    scores = _scores(router_logits, scoring)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if topk_group < num_expert_group:
        choice = _keep_best_groups(choice, num_expert_group, topk_group, e_score_correction_bias)
    # else every group is kept (GLM-4.5 has one): no group mask to build
    topk_ids = torch.topk(choice, top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        # The epsilon is transformers': sigmoid weights could all underflow to 0.
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def _keep_best_groups(
    choice: Tensor,  # [T, E] float32
    num_groups: int,
    topk_group: int,
    bias: Tensor | None,
) -> Tensor:  # [T, E]: choice, -inf outside each token's best topk_group groups
    num_tokens, num_experts = choice.shape
    # [T, G, E/G] (sized explicitly: T may be 0)
    grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
    if bias is None:
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices  # [T, G']
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return choice.masked_fill(expert_mask == 0, float("-inf"))


def _scores(router_logits: Tensor, scoring: Scoring) -> Tensor:  # [T, E] float32
    match scoring:
        case Scoring.SOFTMAX:
            return torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        case Scoring.SIGMOID:
            return torch.sigmoid(router_logits.float())
        case _:
            assert_never(scoring)


def _check_top_k(router_logits: Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {router_logits.shape[1]}], got {top_k}")
