"""Run one real ``vllm.LLM`` engine through a list of requests; report as JSON.

Usage: ``python engine_run.py SPEC.json RESULT.json``. Run by the e2e tests in a
fresh interpreter, so each engine gets exactly the plugins and settings of its
own environment (``VLLM_PLUGINS``, ``VLLM_MAMBA_ALIGN_MODE``, multiprocessing).

The spec names the model directory, the ``LLM`` keyword arguments and the steps:
each step sends one prompt (token ids) with ``max_tokens=1`` and records how
many prompt tokens vLLM served from its prefix cache and the logprobs of the
first generated token (the prefill's output). A step may first reset the
prefix cache, which makes it a fresh run of its prompt. A step may also name
``companions``: prompts sent in the same ``generate`` call ahead of its own, so
they share the scheduler's steps (and token budget) with it; only the step's
own prompt is reported.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    llm = LLM(model=spec["model"], **spec["engine"])
    start_seconds = time.monotonic() - started

    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=spec["logprobs"])
    steps: dict[str, Any] = {}
    for step in spec["steps"]:
        if step.get("reset_cache") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")
        companions = [
            TokensPrompt(prompt_token_ids=p) for p in step.get("companions", [])
        ]
        *_, output = llm.generate(
            [*companions, TokensPrompt(prompt_token_ids=step["prompt"])],
            sampling,
            use_tqdm=False,
        )
        completion = output.outputs[0]
        first = completion.logprobs[0] if completion.logprobs else {}
        steps[step["name"]] = {
            "request_id": output.request_id,
            "num_cached_tokens": output.num_cached_tokens,
            "token": completion.token_ids[0],
            # float -> repr keeps every bit through JSON
            "logprobs": {str(t): repr(lp.logprob) for t, lp in first.items()},
        }
    # The front end's copy of the settings the engine resolved (vLLM's defaults
    # included); in-process it is the engine core's own.
    cache_config = llm.llm_engine.vllm_config.cache_config
    resolved = {
        name: getattr(cache_config, name, None)
        for name in ("prefix_cache_retention_interval", "mamba_cache_mode")
    }
    with open(result_path, "w") as f:
        json.dump(
            {"start_seconds": start_seconds, "steps": steps, "resolved": resolved}, f
        )


if __name__ == "__main__":  # vLLM's engine processes are spawned: guard the entry
    main(sys.argv[1], sys.argv[2])
