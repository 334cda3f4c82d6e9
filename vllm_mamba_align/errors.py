"""The one exception type the plugin raises, so users can tell our refusals apart."""


class MambaAlignError(RuntimeError):
    """The plugin refuses to let vLLM start rather than run a fix it cannot vouch for.

    Every message names the problem and the way out (a setting, a vLLM release).
    """
