"""One witness run, in a process of its own: ``python -m witness.run`` (with
``tests`` on ``PYTHONPATH``) loads vLLM's general plugins as vLLM does
(``VLLM_PLUGINS`` chooses which, ``VLLM_MAMBA_ALIGN_MODE`` the plugin's mode),
runs every workload under the witness and prints one JSON object per
workload: the witness's findings and the events that occurred.

The process never imports the plugin itself; whether vLLM's loader installed
it is reported (``patched``: the scheduler's ``__init__`` is wrapped), and
whether the plugin's package was imported by the time vLLM's loader returned
and after every workload ran (without the plugin: never).
"""

from __future__ import annotations

import dataclasses
import json
import sys


def main() -> None:
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler

    load_general_plugins()
    patched = hasattr(Scheduler.__init__, "__wrapped__")
    from witness.workloads import drive, workloads

    loaded = "vllm_mamba_align" in sys.modules
    names = set(sys.argv[1:])
    for workload in workloads():
        if names and workload.name not in names:
            continue
        findings, events = drive(workload)
        line = {
            "workload": workload.name,
            "patched": patched,
            "plugin_loaded_by_vllm": loaded,
            "plugin_imported_at_end": "vllm_mamba_align" in sys.modules,
            "findings": dataclasses.asdict(findings),
            "events": dataclasses.asdict(events),
        }
        print("WITNESS " + json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
