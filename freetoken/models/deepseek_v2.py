"""DeepSeek-V2 (V2, V2-Lite, V2.5): DeepSeek-V3's model (models/deepseek_v3.py) with softmax
routing, greedy or group-limited greedy (`topk_method`), the chosen probabilities times the
routed scaling and never renormalised, as transformers computes them (its config's
`norm_topk_prob` is read by neither); rotary pairs always adjacent; optional MLP biases; no
dense layers unless `first_k_dense_replace` says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from freetoken.layers.routers import Router, SoftmaxGroupedTopK
from freetoken.models import deepseek_gguf, deepseek_v3

MODEL_TYPE = "deepseek_v2"


@dataclass(frozen=True)
class ModelArgs(deepseek_v3.ModelArgs):
    topk_method: str = "greedy"

    FIRST_DENSE: ClassVar[int] = 0

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        a = super().from_dict(cfg)
        grouped = a.topk_method == "group_limited_greedy"
        return dataclasses.replace(
            a,
            n_group=a.n_group if grouped else 1,
            topk_group=a.topk_group if grouped else 1,
            norm_topk_prob=False,
            rope_interleave=True,
        )


class Model(deepseek_v3.Model):
    Args = ModelArgs
    GATING = deepseek_gguf.GATING_SOFTMAX

    @staticmethod
    def router_of(a: ModelArgs) -> Router:
        return SoftmaxGroupedTopK(
            a.hidden_size,
            a.num_experts,
            a.num_experts_per_tok,
            n_group=a.n_group,
            topk_group=a.topk_group,
            routed_scaling=a.routed_scaling_factor,
        )
