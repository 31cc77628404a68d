"""Sparse delta sync: only the elements that changed since the bytes a destination holds.

`codec` finds and encodes changes (no I/O); `frames` lays them out on the wire; `digest`
checksums written ranges on both ends; `sender` and `receiver` are the trainer and
engine halves.
"""
