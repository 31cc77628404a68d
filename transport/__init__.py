"""Data planes behind one contract (`base.Transport`): tcp, verbs, cuda."""

from .base import ImmHandler, LocalRegion, Transport

__all__ = ["ImmHandler", "LocalRegion", "Transport"]
