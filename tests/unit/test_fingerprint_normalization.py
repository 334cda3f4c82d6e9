"""Fingerprints recognize code, not its layout (no vLLM needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from vllm_mamba_align.fingerprint import (
    analyse_source,
    fingerprint_node,
    fingerprint_source,
    method_in_file,
)

SPLIT = '''
def _mamba_block_aligned_split(
    self, request, num_new_tokens, num_new_local_computed_tokens=0,
    num_external_computed_tokens=0,
):
    """vLLM's docstring."""
    block_size = self.cache_config.block_size  # the grid
    start = request.num_computed_tokens + num_new_local_computed_tokens
    if start + num_new_tokens < request.num_prompt_tokens:
        num_new_tokens = (start + num_new_tokens) // block_size * block_size - start
    return num_new_tokens
'''

REFORMATTED = '''
def _mamba_block_aligned_split(self, request, num_new_tokens,
                               num_new_local_computed_tokens=0,
                               num_external_computed_tokens=0):
    """Another docstring, reworded."""
    # a comment line
    block_size = self.cache_config.block_size


    start = (request.num_computed_tokens
             + num_new_local_computed_tokens)  # trailing comment
    if start + num_new_tokens < request.num_prompt_tokens:
        num_new_tokens = (
            (start + num_new_tokens) // block_size * block_size - start
        )
    return num_new_tokens
'''


def test_comments_docstrings_and_formatting_do_not_change_a_fingerprint() -> None:
    assert fingerprint_source(SPLIT) == fingerprint_source(REFORMATTED)
    without_docstring = SPLIT.replace('    """vLLM\'s docstring."""\n', "")
    assert fingerprint_source(without_docstring) == fingerprint_source(SPLIT)
    indented = textwrap.indent(SPLIT, "    ")  # a method, as inspect returns it
    assert fingerprint_source(indented) == fingerprint_source(SPLIT)


def test_an_edit_changes_the_fingerprint() -> None:
    edits = [
        SPLIT.replace("// block_size * block_size", "// block_size * block_size + 1"),
        SPLIT.replace("<", "<="),
        SPLIT.replace(
            "num_new_local_computed_tokens=0", "num_new_local_computed_tokens=1"
        ),
        SPLIT.replace(
            "    return num_new_tokens", "    x = 1\n    return num_new_tokens"
        ),
    ]
    for edited in edits:
        assert edited != SPLIT
        assert fingerprint_source(edited) != fingerprint_source(SPLIT)


def test_the_structural_facts_of_a_split() -> None:
    shape = analyse_source(SPLIT)
    assert shape.grid_reads == 1
    assert shape.structurally_compatible
    assert "request.num_prompt_tokens" in shape.names
    twice = SPLIT.replace(
        "return num_new_tokens", "return self.cache_config.block_size"
    )
    assert not analyse_source(twice).structurally_compatible


def test_a_method_read_from_its_file_has_the_fingerprint_of_its_source(
    tmp_path: Path,
) -> None:
    """How doctor reads Model Runner V2's seed without importing GPU code."""
    module = tmp_path / "model_state.py"
    method = textwrap.indent(SPLIT, "    ")
    module.write_text(f"import torch\n\n\nclass ModelState:\n    x = 1\n{method}\n")
    node = method_in_file(str(module), "ModelState", "_mamba_block_aligned_split")
    assert node is not None
    assert fingerprint_node(node) == fingerprint_source(SPLIT)
    assert method_in_file(str(module), "ModelState", "absent") is None
    assert method_in_file(str(module), "Other", "_mamba_block_aligned_split") is None
