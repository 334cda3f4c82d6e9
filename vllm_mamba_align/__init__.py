"""vLLM plugin: correct align-mode prefix caching of hybrid Mamba/GDN models.

Enable with ``VLLM_PLUGINS=mamba_align`` (list every other plugin you need too).
Importing this package is cheap and touches nothing; vLLM calls :func:`register`.

The package itself imports nothing outside the standard library, so a missing
dependency (``wrapt``, ``packaging``) surfaces inside :func:`register`, where vLLM
lets the error stop the start, instead of at import, which vLLM only logs (the
fix would then be silently off).
"""

from .errors import MambaAlignError
from .version import __version__

__all__ = ["MambaAlignError", "__version__", "register"]

MISSING_DEPENDENCY = (
    "vllm-mamba-align cannot load in this Python: {error}. Without it vLLM would "
    "run without the fix. Install the plugin with its dependencies into vLLM's "
    "environment: pip install vllm-mamba-align (or pip install 'wrapt>=1.14' "
    "'packaging>=21'); or leave mamba_align out of VLLM_PLUGINS to run stock vLLM."
)


def register() -> None:
    """Entry point of the ``mamba_align`` plugin (group ``vllm.general_plugins``)."""
    try:
        from .plugin import register as register_plugin
    except ImportError as error:
        raise MambaAlignError(MISSING_DEPENDENCY.format(error=error)) from error
    register_plugin()
