"""The OpenVINO backend: a GGUF block range as one compiled stateful OpenVINO model."""

from backends.openvino.shard import OpenVINOShard

__all__ = ["OpenVINOShard"]
