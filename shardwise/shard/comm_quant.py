"""The engine's quantised-communication policy: which collectives of a unit move quantised
data (the codecs themselves are :mod:`shardwise.quant`)."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.quant import GRAD_KINDS, WEIGHT_KINDS, check_block_size, check_kind

__all__ = ["CommQuant"]


@dataclass(frozen=True)
class CommQuant:
    """Which collectives of a sharded unit move quantized data, and how.

    Raises:
        ValueError: a field outside its choices, naming the value and the valid ones.
    """

    weights: str | None = None
    """Parameter all-gather codec: "int8", "fp8" (e4m3) or None (gather unquantized)."""
    grads: str | None = None
    """Gradient reduce-scatter codec: "int8", "int4" or None (reduce unquantized)."""
    block_size: int = 256
    """Elements per quantization block (one fp32 scale each); 256 costs 4 bytes per 256."""
    hierarchy: int | None = None
    """Ranks per node for a secondary (hierarchical) parameter partition, or None (off)."""
    rest_unquantised: bool = False
    """With ``weights``: gather the parameters no low-bit layer lends codes for unquantised
    even in a ``shard`` call where no layer lends any (a pipeline's embedding or head piece
    in a run whose blocks gather fp8 codes). In a call where one does, they always travel
    unquantised ([Note: scaled gathers in the engine]). Default False."""

    def __post_init__(self) -> None:
        if self.weights is not None:
            check_kind(self.weights, WEIGHT_KINDS + (None,), "CommQuant.weights")
        if self.grads is not None:
            check_kind(self.grads, GRAD_KINDS + (None,), "CommQuant.grads")
        check_block_size(self.block_size)
        h = self.hierarchy
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
            raise ValueError(f"CommQuant.hierarchy must be None or an int >= 1, got {h!r}")
        if not isinstance(self.rest_unquantised, bool):
            raise ValueError(f"CommQuant.rest_unquantised must be a bool, got "
                             f"{self.rest_unquantised!r}")
        if self.rest_unquantised and h:
            raise ValueError(f"CommQuant.rest_unquantised with hierarchy={h}: the secondary "
                             f"partition serves the weights codec's gathers only")

    @property
    def enabled(self) -> bool:
        """Whether anything is quantized or partitioned hierarchically."""
        return bool(self.weights or self.grads or self.hierarchy)
