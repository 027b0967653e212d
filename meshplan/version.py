"""meshplan's version: one place, read by the package root (``meshplan.__version__``) and by the modules that
record or compare it (the cross-rank agreement, checkpoint manifests) without importing the root's loaders."""

__version__ = "0.1.0"
