"""Tools on top of the plugin: never imported on the serving path.

- ``sim``: a real vLLM scheduler on CPU (config-only tiny hybrid model, no
  GPU, no weights), a model of the Mamba states its worker would write, and an
  oracle that judges them by what vLLM does.
- ``modes``: stock vLLM and each plugin mode in one process (``stock_vllm``,
  ``scheduler_mode``), for ``simulate``, the benchmarks and the tests.
- ``simulate``: the ``vllm-mamba-align simulate`` command.
- ``interpreters``: the fingerprinted sites of a wheel, on Python 3.10-3.13.
- ``drafting``: a release's code read, diffed and drafted into a table entry
  (for ``tools/onboard.py``; reads files only, needs no vLLM installed).
- ``nightlies``: which split bodies vLLM main's nightly builds carry, known to
  the table or not (reads wheels only, needs no vLLM installed).

They need vLLM (and torch) installed; the package's dependencies do not include
them. ``tests/test_serving_path.py`` checks that ``register()`` and a running
scheduler import none of these modules.
"""
