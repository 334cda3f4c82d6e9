"""Which Mamba backends vLLM lets run batch-invariant, read from its code
(``batch_invariance.mamba_backends_accepting_batch_invariance``) on a vLLM package
written here: none through 0.33.0, the short-convolution backend from 0.34.0."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from vllm_mamba_align import batch_invariance, releases

REGISTRY = '''
class MambaAttentionBackendEnum(Enum, metaclass=_Meta):
    """The backends."""

    MAMBA2 = "vllm.v1.attention.backends.mamba2_attn.Mamba2AttentionBackend"
    SHORT_CONV = "vllm.v1.attention.backends.short_conv_attn.ShortConvAttentionBackend"
    CUSTOM = ""
'''
SHORT_CONV_033 = """
class ShortConvAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "SHORT_CONV_ATTN"
"""
SHORT_CONV_034 = (
    SHORT_CONV_033
    + """
    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True
"""
)
MAMBA2 = """
class Mamba2AttentionBackend(AttentionBackend):
    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False
"""


def vllm_package(root: Path, short_conv: str) -> Path:
    backends = root / "vllm" / "v1" / "attention" / "backends"
    backends.mkdir(parents=True)
    (backends / "registry.py").write_text(textwrap.dedent(REGISTRY))
    (backends / "short_conv_attn.py").write_text(short_conv)
    (backends / "mamba2_attn.py").write_text(MAMBA2)
    return root / "vllm"


@pytest.mark.parametrize(
    ("short_conv", "accepting"),
    [(SHORT_CONV_033, ()), (SHORT_CONV_034, ("SHORT_CONV",))],
    ids=["0.33.0", "0.34.0"],
)
def test_a_backend_answering_true_is_read_as_accepting(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    short_conv: str,
    accepting: tuple[str, ...],
) -> None:
    package = vllm_package(tmp_path, short_conv)
    monkeypatch.setattr(releases, "vllm_package_dir", lambda: package)
    assert batch_invariance.mamba_backends_accepting_batch_invariance() == accepting


def test_without_a_readable_registry_no_backend_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(releases, "vllm_package_dir", lambda: tmp_path)
    assert batch_invariance.mamba_backends_accepting_batch_invariance() == ()
    monkeypatch.setattr(releases, "vllm_package_dir", lambda: None)
    assert batch_invariance.mamba_backends_accepting_batch_invariance() == ()
