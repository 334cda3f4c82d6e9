"""Draw docs/img/audit-counter.png from the live check's Prometheus data.

``MAMBA_ALIGN_MONITORING_RECORD=docs/img/audit-counter.json nox -s e2e_monitoring``
records, from the run's Prometheus, the would-be-poisoned-slots counter of the
``audit`` server and of the server in the default mode (which exports no audit
counter: drawn at 0 while its info series exists); ``nox -s monitoring_picture``
runs this script on it (matplotlib, installed in that session only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
DATA = HERE / "audit-counter.json"
PICTURE = HERE / "audit-counter.png"
LABELS = {
    "audit": "VLLM_MAMBA_ALIGN_MODE=audit (stock scheduling, counted)",
    "default": "default mode lean (the fix): no audit series, drawn at 0",
}


def main(data: Path = DATA, picture: Path = PICTURE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recorded = json.loads(data.read_text())
    starts = [points[0][0] for points in recorded["series"].values() if points]
    origin = min(starts)
    figure, axes = plt.subplots(figsize=(8, 3.2), dpi=100)
    for key, points in recorded["series"].items():
        axes.step(
            [t - origin for t, _ in points],
            [v for _, v in points],
            where="post",
            label=LABELS.get(key, key),
        )
    axes.set_xlabel("seconds since the first scrape")
    axes.set_ylabel("would-be-poisoned slots")
    axes.set_title(recorded["counter"], fontsize=9)
    axes.legend(fontsize=8, loc="upper left")
    axes.grid(alpha=0.3)
    note = recorded.get("note")
    if note:
        figure.text(0.01, 0.01, note, fontsize=6, color="gray")
    figure.tight_layout()
    figure.savefig(picture)
    print(f"wrote {picture}")


if __name__ == "__main__":
    main(*(Path(argument) for argument in sys.argv[1:3]))
