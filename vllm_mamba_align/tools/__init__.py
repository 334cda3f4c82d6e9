"""What an operator runs on top of the plugin: never imported on the serving path.

- ``sim``: a real vLLM scheduler on CPU (config-only tiny hybrid model, no
  GPU, no weights), a model of the Mamba states its worker would write, and an
  oracle that judges them by what vLLM does.
- ``modes``: stock vLLM and each plugin mode in one process (``stock_vllm``,
  ``scheduler_mode``), for ``simulate``, the benchmarks and the tests.
- ``simulate``: the ``vllm-mamba-align simulate`` command.

They need vLLM (and torch) installed; the package's dependencies do not include
them. ``tests/test_serving_path.py`` checks that ``register()`` and a running
scheduler import none of these modules.
"""
