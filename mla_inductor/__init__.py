"""mla-inductor: DeepSeek-style sparse MLA attention as ``torch.compile``-native custom ops.

Public names: :func:`sparse_mla`, :func:`use_backend`, :func:`precompile`, ``__version__``.
"""

from .api import sparse_mla
from .backends import use_backend
from .precompile import precompile

__version__ = "0.1.0"
__all__ = ["sparse_mla", "use_backend", "precompile", "__version__"]
