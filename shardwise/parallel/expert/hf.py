"""Expert parallelism for Hugging Face MoE decoders built from a config.

transformers 5.x stores the routed experts of its MoE models (Mixtral, Qwen2/3-MoE,
DeepSeek-V3, OLMoE, gpt-oss, ...) as one module of stacked 3-D parameters
(``gate_up_proj`` ``(E, 2 * I, H)``, ``down_proj`` ``(E, H, I)``, optional biases ``(E,
...)``) called by the sparse block as ``experts(hidden_states, top_k_index,
top_k_weights)`` after its own router. :class:`FusedExpertsEP` replaces that call by
dispatch -> local experts -> combine ([Note: expert dispatch] in dispatch.py): the
assignments are sorted by expert as shardwise's own MoE layer sorts them (slot-major, stable),
the rows travel to the ranks holding their experts, and there the module's *own* forward
(whatever ``config._experts_implementation`` selects: eager, grouped_mm, batched_mm) runs
on them with ``num_experts`` set to the local count, each row its own token with weight 1.
The outputs come back in order and are weighted by ``top_k_weights`` and summed over the
``top_k`` slots, so the router, its weights' gradient and the rest of the block are
Hugging Face's, untouched.
"""

from __future__ import annotations

import torch

from shardwise.models.router import sort_by_expert
from shardwise.parallel.expert.dispatch import dispatch_compute_combine

__all__ = ["FusedExpertsEP"]


class FusedExpertsEP:
    """Expert-parallel forward of a Hugging Face experts module (mixed in before its class;
    ``self._shardwise_ep`` is the layer's :class:`~shardwise.parallel.expert.dispatch.
    ExpertGroup`)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        g = self._shardwise_ep
        n, k = top_k_index.shape
        route = sort_by_expert(top_k_index.to(torch.int64), g.num_experts)
        x = hidden_states[route.order % n]  # (M, H) sorted by expert

        def local(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            m = rows.shape[0]
            ids = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device),
                                          counts, output_size=m).unsqueeze(1)  # (R, 1)
            ones = torch.ones(m, 1, dtype=top_k_weights.dtype, device=rows.device)
            return super(FusedExpertsEP, self).forward(rows, ids, ones)  # (R, H)

        y = dispatch_compute_combine(x, route.counts, g, local)  # (M, H)
        w = top_k_weights.t().reshape(-1)[route.order]  # (M,) the rows' routing weights
        slots = y.new_zeros(k * n, y.shape[-1]).index_copy(
            0, route.order, y * w.unsqueeze(-1).to(y.dtype))
        return slots.view(k, n, -1).sum(dim=0)  # (N, H)
