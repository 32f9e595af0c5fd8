"""Compatibility shim: alternative kernel implementations (see :mod:`.registry`)."""
