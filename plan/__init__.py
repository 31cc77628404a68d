"""Planning: recipes matched by name, and the static routing plan (no torch, no I/O)."""
