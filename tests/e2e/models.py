"""Tiny models written to disk for the e2e tests (no hub access needed).

Random weights (fixed seed, a wide init range) so that logits are far from flat
and a wrong recurrent state shows in the logprobs; fp32 for determinism.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 512

# Head dim 32: the CPU attention kernels reject smaller heads.
NEMOTRON_H: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    # Mamba2, attention, Mamba2, MLP
    "layers_block_type": [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "mlp",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "ssm_state_size": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 32,
    "n_groups": 1,
    "expand": 2,
    "chunk_size": 64,
    "max_position_embeddings": 8192,
    "use_mamba_kernels": False,
    "initializer_range": 0.1,
}

# A hybrid mixture-of-experts model of the same size: Granite 4.0-H's
# architecture (GraniteMoeHybrid: Mamba2 and attention layers, each followed by
# routed experts and a shared MLP, SiLU-gated). vLLM treats it as MoE
# (``model_config.is_moe``) and runs its data-parallel ranks in lockstep.
# NemotronH's "moe" layers do not run on the CPU build: their experts are not
# gated (relu2), which vLLM 0.32.0's fused-MoE config refuses off CUDA, XPU and
# ROCm ("is_act_and_mul=False is supported only for CUDA, XPU and ROCm").
GRANITE_MOE_HYBRID: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "mamba"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "shared_intermediate_size": 64,
    "mamba_n_heads": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "position_embedding_type": "rope",
    "max_position_embeddings": 8192,
    "initializer_range": 0.1,
}

LLAMA: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "max_position_embeddings": 8192,
    "initializer_range": 0.1,
}


def write_model(kind: str, directory: Path, seed: int = 0) -> Path:
    """Write config.json and random safetensors weights for a tiny model."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        GraniteMoeHybridConfig,
        LlamaConfig,
        NemotronHConfig,
    )

    config_class, fields = {
        "nemotron_h": (NemotronHConfig, NEMOTRON_H),
        "granite_moe_hybrid": (GraniteMoeHybridConfig, GRANITE_MOE_HYBRID),
        "llama": (LlamaConfig, LLAMA),
    }[kind]
    config = config_class(**fields, torch_dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    # transformers writes an infinite time_step_limit as a non-JSON marker; the
    # default (0, inf) is what vLLM uses anyway.
    config_path = directory / "config.json"
    written = json.loads(config_path.read_text())
    written.pop("time_step_limit", None)
    config_path.write_text(json.dumps(written, indent=1))
    return directory
