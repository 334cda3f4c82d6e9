"""vLLM plugin: correct align-mode prefix caching of hybrid Mamba/GDN models.

Enable with ``VLLM_PLUGINS=mamba_align`` (list every other plugin you need too).
Importing this package is cheap and touches nothing; vLLM calls :func:`register`.
"""

__version__ = "0.1.0"

from .errors import MambaAlignError
from .plugin import register

__all__ = ["MambaAlignError", "__version__", "register"]
