"""Facts about this node: its GPUs through NVML (``gpu``) and whether it can checkpoint (``doctor``)."""

__all__ = ["gpu", "doctor"]
