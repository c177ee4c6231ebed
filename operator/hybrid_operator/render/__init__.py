"""Pure builders: a HybridInference body in, Kubernetes object dicts out. No I/O here."""
from .children import render_children

__all__ = ["render_children"]
