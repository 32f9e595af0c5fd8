"""Compatibility shims for import paths callers use (see :mod:`.loss_utils`)."""
