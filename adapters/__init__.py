"""Adapters that put weightwire inside inference engines (`weightwire.adapters.sglang`)."""
