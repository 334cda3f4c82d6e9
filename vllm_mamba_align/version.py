"""The plugin's version, in a module of its own.

The start line, ``doctor``, ``/metrics`` and the probe's report name it, and
the package root re-exports it; kept apart from the root so that the serving
path (plugin -> activation -> metrics) reads it without importing back the
root whose ``register()`` imports the plugin.
"""

__version__ = "0.1.0"
