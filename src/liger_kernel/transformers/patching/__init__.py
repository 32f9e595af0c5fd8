"""The patching layer: options, per-instance binding, class-level record, replacements,
instance patching and the public API (re-exported by :mod:`liger_kernel.transformers.monkey_patch`)."""
