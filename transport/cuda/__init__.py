"""cuda: same-host writes between GPU memory (NVLink/PCIe) through CUDA IPC."""

from .transport import CudaTransport, host_id

__all__ = ["CudaTransport", "host_id"]
