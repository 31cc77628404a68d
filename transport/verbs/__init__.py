"""verbs: the one-sided write contract over RDMA (RC queue pairs, pyverbs), the production
data plane. Importing this package does not import pyverbs; `available()` says whether
this machine can run it."""

from .devices import available, discover
from .ibv import VerbsUnavailable
from .transport import VerbsTransport

__all__ = ["VerbsTransport", "VerbsUnavailable", "available", "discover"]
