"""``python -m vllm_mamba_align``: the same command as ``vllm-mamba-align``."""

import sys

from .cli import main

sys.exit(main())
