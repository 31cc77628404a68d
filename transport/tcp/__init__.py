"""tcp: the one-sided write contract over plain TCP, for clusters without RDMA."""

from .transport import TcpTransport

__all__ = ["TcpTransport"]
