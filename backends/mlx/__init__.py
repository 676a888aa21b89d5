"""The MLX backend: a GGUF block range on MLX (Metal on macOS, `mlx[cpu]` on Linux)."""

from backends.mlx.shard import MLXShard, SlotState

__all__ = ["MLXShard", "SlotState"]
