"""Test-only vLLM general plugin: four gaps of the CPU backend, bridged for e2e.

Installed only into the e2e test environment (``nox -s e2e``) and enabled by
listing ``cpu_e2e_workarounds`` in ``VLLM_PLUGINS``. It is a plugin (not a
monkeypatch inside the test) because vLLM's default multiprocess mode builds the
model and the scheduler in other processes, and vLLM loads general plugins in
every one of them. Nothing here is part of vllm-mamba-align.

Gap 1 (chunk-internal checkpoints). vLLM 0.32.0 lets Mamba2 layers declare one
"prefill checkpoint block": in align mode the scheduler then no longer splits a
prefill at state-block boundaries itself, and the layer asks the SSD kernel for
the intermediate states so the boundary state is exported from inside one
forward pass. The CPU build's SSD path cannot return those intermediate states
(the forward pass fails with an IndexError). Declaring zero checkpoint blocks
puts the scheduler back in charge of splitting chunks at boundaries, which is
the path vllm-mamba-align fixes and these tests exercise.

Gap 2 (state copies). In align mode the worker moves Mamba states between
blocks before and after each step. With speculative decoding on a hybrid model
vLLM 0.32.0 always takes fused Triton kernels for that (``precopy`` and
``postprocess``), and the CPU build has no fallback for them; its scalar path
ends in ``batch_memcpy``, a Triton kernel too. The stand-ins:
``preprocess_mamba`` is called without the fused context, so vLLM's own scalar
path (``collect_mamba_copy_meta`` + ``do_mamba_copy_block``) runs; the post-step
copy is decided per request in Python by the rule the fused kernel states (the
running state moves to the last block boundary the accepted tokens reached) and
collected through the same scalar helper; the byte copies are ``ctypes.memmove``
on host memory. Both run for real in the served witness's drafter pair
(tests/e2e/test_witness_served.py): its requests decode a few tokens, every
decode step verifies the drafter's token (``extract_hidden_states`` proposes
one per step), and the post-step stand-in copies the running state into the
block of the boundary the request reached (or the accepted draft carried it
to). With ``MAMBA_ALIGN_E2E_POST_STEP_TRACE`` set to a file path, it appends
one JSON line per row that verified drafts (request, running-state length,
accepted drafts, running column, the copy as ``[bias, target column]`` or
null); that test holds those rows, accepted counts and copies to the
witness's mirror of vLLM's rule.

Gap 3 (an MoE model's data-parallel exchange). With ``--data-parallel-size`` > 1
an MoE layer gathers every rank's tokens before its experts and hands each rank
its share of the sum after (vLLM 0.32.0's ``AgRsAll2AllManager.dispatch`` and
``combine`` in ``device_communicators/all2all.py``), through the device
communicator's ``all_gatherv`` and ``reduce_scatterv``. The CPU communicator
inherits the base class's, which raise ``NotImplementedError``
(``base_device_communicator.py``), so the first step of any rank fails. The
stand-ins do the same exchange with the communicator's own collectives
(``all_gather`` of tensors padded to the largest rank's size, then trimmed;
``all_reduce``, then this rank's rows).

Gap 4 (the Ray backend's device), only where ``MAMBA_ALIGN_E2E_RAY_DEVICE_KEY``
is set (to the Ray resource to use, ``CPU``). vLLM's Ray data-parallel backend
places each rank in a placement group of ``current_platform.ray_device_key``
bundles (``CoreEngineActorManager.create_dp_placement_groups``,
``vllm/v1/engine/utils.py``); the CPU platform names no Ray device (the empty
key), so the launch stops at "No  found in Ray cluster" before any engine actor
exists. The stand-in gives the CPU platform class the key, so each rank takes
Ray's ``CPU`` resources. Only the launching process reads the key; the variable
is not copied into Ray actors (vLLM copies ``VLLM_*`` variables only), and
without it the CPU platform keeps its empty key (tests/e2e/test_distributed.py
checks that key on the real platform).

Also (not a workaround): with ``MAMBA_ALIGN_E2E_TRACE`` set to a file path, every
prefill chunk the scheduler hands out is appended to that file as one JSON line
(request id, the chunk's end, the prompt length, and the cache block C the
scheduler reads at that moment), from whichever process runs the scheduler, so a
test can check where chunks end.

Also (not a workaround): with ``MAMBA_ALIGN_E2E_BF16_STATES`` set, the CPU
engine emulates a GPU's rounding of resumed states (``_round_stored_states``).

Also (not a workaround): with ``MAMBA_ALIGN_E2E_DUMMY_STEPS`` set, every dummy
batch an engine core steps (vLLM's ``EngineCore.execute_dummy_batch``; a
lockstep data-parallel rank calls it from its busy loop when the wave goes on
and it ran nothing of its own) prints one line naming the rank, so a test can
see an idle lockstep rank step. vLLM's own report of dummy iterations
(``--enable-logging-iteration-details``) is sent only where no DP coordinator
runs (0.32.0's ``DPEngineCoreProc.run_busy_loop``), and lockstep ranks have one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
from types import ModuleType, SimpleNamespace
from typing import Any

import wrapt

MIXER2_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
WORKER_MAMBA_MODULE = "vllm.v1.worker.mamba_utils"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
CPU_COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cpu_communicator"
TRACE_VARIABLE = "MAMBA_ALIGN_E2E_TRACE"
BF16_STATES_VARIABLE = "MAMBA_ALIGN_E2E_BF16_STATES"
CPU_PLATFORM_MODULE = "vllm.platforms.cpu"
RAY_DEVICE_VARIABLE = "MAMBA_ALIGN_E2E_RAY_DEVICE_KEY"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
DUMMY_STEPS_VARIABLE = "MAMBA_ALIGN_E2E_DUMMY_STEPS"
DUMMY_STEP_LINE = "e2e: dummy batch stepped on data-parallel rank"
POST_STEP_TRACE_VARIABLE = "MAMBA_ALIGN_E2E_POST_STEP_TRACE"
_registered = False


def _without_checkpoint_blocks(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    spec = wrapped(*args, **kwargs)
    if getattr(spec, "num_prefill_checkpoint_blocks", 0):
        spec = dataclasses.replace(spec, num_prefill_checkpoint_blocks=0)
    return spec


def _round_stored_states(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """After a Mamba2 layer's step, round the states it stored to bf16.

    Why: on vLLM's CPU engine a run resumed from a correct cached state equals a
    fresh run exactly (its recurrence is chunk-invariant), so the probe's
    handling of GPU rounding cannot be tested there. A GPU keeps states in a
    bf16 cache (the cache dtype is the model's) and rounds each one where a
    chunk or a decode step ends; a run chunked differently rounds at other
    places. This does the same on the CPU engine: every slot a step wrote (the
    prefill chunks' final states, the decode steps' states, SSM and conv) is
    rounded to bf16 in place, at every chunk end, cached and fresh runs alike.

    Calibrated against the H200 measurement of
    ``/work/shared/reference/gpu-numerics-h200.md`` (vLLM 0.33.0's Triton
    kernels, bf16 state cache): a correct state resumed at a boundary a fresh
    run did not stop at differed from it by 0.016-0.062 (max |Δ logprob| of
    the first token). On the e2e model (tiny NemotronH, ``--dtype bfloat16``,
    C = 8 < B = 32, step budget 1,000) the rounding alone puts a sibling that
    resumes from a correct junction state about 1e-2 off a fresh run (see
    ``docs/probe.md`` for the measured figures), the same order.
    """
    output = wrapped(*args, **kwargs)
    if not os.environ.get(BF16_STATES_VARIABLE):
        return output
    import torch
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict) or metadata.get(instance.prefix) is None:
        return output
    layer = metadata[instance.prefix]
    slots = [
        indices.reshape(-1)
        for indices in (layer.state_indices_tensor_p, layer.state_indices_tensor_d)
        if indices is not None and indices.numel()
    ]
    if not slots:
        return output
    written = torch.unique(torch.cat(slots))
    written = written[written > 0]  # 0 is vLLM's null block: nothing stored
    for state in instance.kv_cache[:2]:
        rows = state[written]
        state[written] = rows.to(torch.bfloat16).to(state.dtype)
    return output


def _patch_mixer2(module: ModuleType) -> None:
    wrapt.wrap_function_wrapper(
        module, "MambaMixer2.get_kv_cache_spec", _without_checkpoint_blocks
    )
    wrapt.wrap_function_wrapper(
        module, "MambaMixer2.conv_ssm_forward", _round_stored_states
    )


def _host_batch_memcpy(src_ptrs: Any, dst_ptrs: Any, sizes: Any) -> None:
    """``batch_memcpy`` for host tensors: one memmove per (src, dst, size) row."""
    for src, dst, size in zip(
        src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), strict=True
    ):
        ctypes.memmove(int(dst), int(src), int(size))


def _scalar_preprocess(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run vLLM's ``preprocess_mamba`` on its scalar path (no fused context)."""
    kwargs["align_ctx"] = None
    return wrapped(*args, **kwargs)


def _make_postprocess(mamba_utils: ModuleType) -> Any:
    def postprocess_on_host(
        *,
        bufs: Any,
        num_reqs: int,
        num_accepted_tokens_gpu: Any,
        num_accepted_tokens_cpu_tensor: Any,
        input_batch: Any,
        kv_cache_config: Any,
        forward_context: dict[str, Any],
        mamba_state_copy_funcs: Any,
    ) -> None:
        """After a step, move each request's running state where it belongs.

        The running state was computed for ``running`` tokens (scheduled tokens
        minus drafts). If the accepted tokens carried the request to or past a
        block boundary ``aligned``, the state after ``aligned`` tokens must live
        in the block that ends there, so it is copied from the running slot
        (offset by the accepted tokens it includes), and the next step starts
        from a single accepted token.
        """
        ctx = bufs.postprocess_align
        copy_bufs = bufs.preprocess
        block_size = copy_bufs.mamba_spec.block_size
        group_ids = copy_bufs.mamba_group_ids
        accepted = num_accepted_tokens_gpu[:num_reqs].tolist()
        state_idx = ctx.mamba_state_idx_buf.np[:num_reqs].tolist()
        scheduled = ctx.num_scheduled_tokens_buf.np[:num_reqs].tolist()
        computed = ctx.num_computed_tokens_buf.np[:num_reqs].tolist()
        drafts = ctx.num_draft_tokens_buf.np[:num_reqs].tolist()
        copy_bufs.offset = 0
        trace = os.environ.get(POST_STEP_TRACE_VARIABLE)
        rows = []
        for i in range(num_reqs):
            running = computed[i] + scheduled[i] - drafts[i]
            aligned = (running + accepted[i] - 1) // block_size * block_size
            bias = aligned - running
            destination = aligned // block_size - 1
            moves = aligned >= running and not (
                destination == state_idx[i] and bias == 0
            )
            if trace and drafts[i] > 0:
                rows.append(
                    {
                        "request": input_batch.req_ids[i],
                        "running": running,
                        "accepted": accepted[i] - 1,
                        "column": state_idx[i],
                        "copy": [bias, destination] if moves else None,
                    }
                )
            if aligned < running:
                continue  # no boundary reached: the running slot stays put
            if destination == state_idx[i]:
                accepted[i] = 1
            table = SimpleNamespace(
                block_ids={
                    gid: input_batch.block_table[gid]
                    .block_table.np[
                        i, : input_batch.block_table[gid].num_blocks_per_row[i]
                    ]
                    .tolist()
                    for gid in group_ids
                }
            )
            mamba_utils.collect_mamba_copy_meta(
                copy_bufs,
                kv_cache_config,
                mamba_state_copy_funcs,
                group_ids,
                state_idx[i],
                destination,
                bias,
                table,
                forward_context,
            )
        mamba_utils.do_mamba_copy_block(copy_bufs)
        for i, value in enumerate(accepted):
            num_accepted_tokens_cpu_tensor[i] = value
        if rows:
            with open(str(trace), "a") as lines:
                lines.write("".join(json.dumps(row) + "\n" for row in rows))

    return postprocess_on_host


def _patch_worker_mamba(module: ModuleType) -> None:
    module.batch_memcpy = _host_batch_memcpy  # type: ignore[attr-defined]
    wrapt.wrap_function_wrapper(module, "preprocess_mamba", _scalar_preprocess)
    module.postprocess_mamba_align_gpu = _make_postprocess(module)  # type: ignore[attr-defined]


def _trace_prefill_chunks(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    output = wrapped(*args, **kwargs)
    path = os.environ.get(TRACE_VARIABLE)
    if not path:
        return output
    lines = []
    for req_id, scheduled in output.num_scheduled_tokens.items():
        request = instance.requests.get(req_id)
        if request is None:
            continue
        end = request.num_computed_tokens  # vLLM advanced it inside schedule()
        prompt = request.num_prompt_tokens
        if end - scheduled < prompt:  # a chunk of the prefill
            lines.append(
                json.dumps(
                    {
                        "request": req_id,
                        "end": end,
                        "prompt": prompt,
                        "cache_block": instance.cache_config.block_size,
                    }
                )
            )
    if lines:
        with open(path, "a") as trace:
            trace.write("".join(line + "\n" for line in lines))
    return output


def _patch_scheduler(module: ModuleType) -> None:
    wrapt.wrap_function_wrapper(module, "Scheduler.schedule", _trace_prefill_chunks)


def _all_gatherv(
    self: Any, input_: Any, dim: int = 0, sizes: list[int] | None = None
) -> Any:
    """Each rank's rows along ``dim`` (``sizes[rank]`` of them), concatenated."""
    import torch
    import torch.distributed as dist

    if isinstance(input_, list | tuple):
        return [_all_gatherv(self, tensor, dim, sizes) for tensor in input_]
    assert sizes is not None and len(sizes) == self.world_size
    moved = input_.movedim(dim, 0).contiguous()
    padded = torch.zeros(
        (max(sizes), *moved.shape[1:]), dtype=moved.dtype, device=moved.device
    )
    padded[: moved.shape[0]] = moved
    gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
    dist.all_gather(gathered, padded, group=self.device_group)
    rows = torch.cat([part[:size] for part, size in zip(gathered, sizes, strict=True)])
    return rows.movedim(0, dim).contiguous()


def _reduce_scatterv(
    self: Any, input_: Any, dim: int = -1, sizes: list[int] | None = None
) -> Any:
    """The sum over ranks, of which this rank keeps its own ``sizes[rank]`` rows."""
    assert sizes is not None and len(sizes) == self.world_size
    summed = self.all_reduce(input_.movedim(dim, 0).contiguous().clone())
    start = sum(sizes[: self.rank_in_group])
    mine = summed[start : start + sizes[self.rank_in_group]]
    return mine.movedim(0, dim).contiguous()


def _patch_cpu_communicator(module: ModuleType) -> None:
    module.CpuCommunicator.all_gatherv = _all_gatherv  # type: ignore[attr-defined]
    module.CpuCommunicator.reduce_scatterv = _reduce_scatterv  # type: ignore[attr-defined]


def _patch_cpu_platform(module: ModuleType) -> None:
    key = os.environ.get(RAY_DEVICE_VARIABLE)
    if key:
        module.CpuPlatform.ray_device_key = key  # type: ignore[attr-defined]


def _print_dummy_steps(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    output = wrapped(*args, **kwargs)
    if os.environ.get(DUMMY_STEPS_VARIABLE):
        print(f"{DUMMY_STEP_LINE} {getattr(instance, 'dp_rank', '?')}", flush=True)
    return output


def _patch_engine_core(module: ModuleType) -> None:
    wrapt.wrap_function_wrapper(
        module, "EngineCore.execute_dummy_batch", _print_dummy_steps
    )


def register() -> None:
    """Entry point (group ``vllm.general_plugins``); idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    wrapt.register_post_import_hook(_patch_mixer2, MIXER2_MODULE)
    wrapt.register_post_import_hook(_patch_worker_mamba, WORKER_MAMBA_MODULE)
    wrapt.register_post_import_hook(_patch_scheduler, SCHEDULER_MODULE)
    wrapt.register_post_import_hook(_patch_cpu_communicator, CPU_COMMUNICATOR_MODULE)
    wrapt.register_post_import_hook(_patch_cpu_platform, CPU_PLATFORM_MODULE)
    wrapt.register_post_import_hook(_patch_engine_core, ENGINE_CORE_MODULE)
