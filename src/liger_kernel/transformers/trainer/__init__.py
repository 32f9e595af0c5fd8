"""Compatibility shims for import paths callers use (see :mod:`.orpo_trainer`)."""
