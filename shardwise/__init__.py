"""shardwise: PyTorch-native distributed training (ZeRO-1/2/3, offload, low precision)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
