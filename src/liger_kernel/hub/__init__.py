"""The Hub-kernel build of liger_kernel: the layers the ``kernels`` package loads.

:mod:`liger_kernel.hub.layers` is the source of the ``layers`` module of the kernel
repository that ``scripts/build_hub_kernel.py`` writes; it imports torch and
:mod:`liger_kernel.ops` only, which the build bundles with relative imports. See
``docs/ecosystem.md`` for the ways users load it.
"""
