"""What a ``selective`` activation-checkpointing policy replays, by software stack.

[Note: selective policies] ``ac=selective`` means "recompute the cheap part", and stacks
differ in what that part is. The workload's ``selective_ac`` names the policy the
software runs; the cost model (stage_cost.py) prices each the same way, from the
layer's own list of work (work.py):

* ``"ops"`` (default, shardwise's policy, ``parallel/checkpointing.py``): every matrix
  multiply's and the attention kernel's outputs are kept; the bandwidth-bound ops (norms,
  RoPE, the activation function; with unfused attention, the attention core as in
  Korthikanti et al. 2022) are replayed. See [Note: selective recomputation] in work.py.
* ``"alternate_mm"``: torchtitan's op-level policy (``selective_ac_option = "op"``,
  2024: ``_save_list`` in ``parallelize_llama.py``) keeps the attention kernel's and
  reduce-scatters' outputs and every *other* ``aten.mm`` output, counting the block's
  multiplies in execution order (wq, wk, wv, wo, w1, w3, w2 in a Llama block: wk, wo and
  w3 are replayed), and recomputes the rest, the bandwidth-bound ops and the tensor-
  parallel all-gathers included. :func:`replayed_matmuls` lists the replayed multiplies.
* ``"layers:N"``: torchtitan's layer policy (``selective_ac_option = "N"``) checkpoints
  every N-th block fully (the 1-based block count divisible by N) and leaves the others
  unchecked: :func:`layer_ac` resolves each block's policy.
"""

from __future__ import annotations

import math

__all__ = ["check_selective", "layer_ac", "replayed_matmuls"]


def check_selective(policy: str) -> None:
    """Validate a ``selective_ac`` value.

    Raises:
        ValueError: not "ops", "alternate_mm" or "layers:N" with an integer N >= 1.
    """
    if policy in ("ops", "alternate_mm"):
        return
    head, _, n = policy.partition(":")
    if head == "layers" and n.isdigit() and int(n) >= 1:
        return
    raise ValueError(f"selective_ac={policy!r}, expected 'ops', 'alternate_mm' or "
                     f"'layers:N' with an integer N >= 1")


def layer_ac(ac: str, policy: str, index: int) -> str:
    """The checkpointing block ``index`` (0-based) runs under layout policy ``ac`` and
    the workload's ``selective_ac`` ``policy`` (full / none for a layer policy)."""
    if ac != "selective" or not policy.startswith("layers:"):
        return ac
    every = int(policy.partition(":")[2])
    return "full" if (index + 1) % every == 0 else "none"


def _block_matmuls(spec, tp: int) -> list[tuple[int, int]]:
    """(out, in) of a dense block's linears on one tensor-parallel rank, in the order
    torchtitan's Llama block runs them (q, k, v, o, then w1, w3, w2 / fc1, fc2)."""
    attn = [s for s in spec.attention_shapes(tp) if len(s) == 2]
    ffn = [s for s in spec.ffn_shapes(0, tp, experts=False) if len(s) == 2]
    if spec.mlp == "swiglu":
        ffn = [ffn[0], ffn[2], ffn[1]]  # registered w1, w2, w3; run w1, w3, then w2
    return attn + ffn


def replayed_matmuls(spec, moe: bool, tokens: float, tp: int, gemms) -> list[float]:
    """FLOPs of each multiply ``alternate_mm`` replays in one layer's recomputation.

    Args:
        spec: the ModelSpec; moe: the layer's feed-forward is a mixture of experts.
        tokens: tokens of the micro-batch on this rank; tp: tensor-parallel degree.
        gemms: the layer's ``LayerWork.gemms`` ((FLOPs, count), ...), used for blocks
            whose multiplies are not plain linears (MLA, experts): every second one of
            that list, in its order.
    """
    if moe or spec.is_mla:
        flat = [f for f, n in gemms for _ in range(n)]
        return flat[1::2]
    return [2 * tokens * math.prod(s) for s in _block_matmuls(spec, tp)[1::2]]
