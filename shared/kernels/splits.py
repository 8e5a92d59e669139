"""How many programs a decode kernel splits each sequence into (flash-decoding), from shapes only
(no host sync, a fixed grid) and the compiled kernel's residency: programs move equal bytes, so
time = waves x one program, and a last wave a third full costs a third of the time."""
from __future__ import annotations

import logging
import math

import torch

from kvmesh.kernels.work_list import MAX_WORK_SPLITS, BatchContexts, WorkPlan

NUM_SMS_DEFAULT = 132  # H200; the real count is read from the device when there is one
RESIDENT_DEFAULT = 4  # programs per SM assumed where the compiled kernel cannot be inspected
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism
PROGRAM_COST_TOKENS = 128  # a program's fixed cost (prologue, tail, partial write) in tokens read
MAX_SPLITS = 64
REGS_PER_SM = 65536
SM_QUARTERS = 4  # an SM's schedulers, each with a quarter of the register file
# the second-launch reduction's tile: heads a program, splits a step. Best of 28 tiles (1 or 4 heads,
# 8-64 splits, 4 or 8 warps, 1 or 3 stages) on six sets of partials, H200 (benchmarks/split_reduce.py):
# 2.4-6.3 us, against 3.3-17.7 for one head a program with up to 64 splits a step
REDUCE_HEADS, REDUCE_SPLITS = 4, 32


def waves(batch: int, kv_heads: int, capacity: int, splits: int, contexts: BatchContexts | None = None) -> int:
    """Waves of `capacity` programs a launch takes at `splits` for its longest sequence: every
    sequence that many (`contexts` None: all as long as the longest), or a ragged batch's work list
    (each sequence split in proportion to its context, `work_list.py`), where that has fewer units.
    Either way no program reads more than one split of the longest sequence."""
    units = contexts.units(splits) if contexts is not None and contexts.pays(splits) else batch * splits
    return -(-kv_heads * units // capacity)


def num_splits(batch: int, kv_heads: int, max_context: int, num_sms: int,
               resident_per_sm: int = RESIDENT_DEFAULT, block_n: int = 64,
               contexts: BatchContexts | None = None) -> int:
    """Splits per (sequence, KV head), from shapes only. Programs move equal bytes, so the time is
    waves (programs / programs resident at once, rounded up) x one program's time (its tokens plus a
    fixed cost worth PROGRAM_COST_TOKENS): e.g. 16 x 8 programs on 132 SMs x 4 want 4 splits (one
    full wave), not 5 (a second wave 20 % full); 64 x 8 want none. `contexts`: a ragged batch's
    (None: all at max_context), whose work list splits each sequence in proportion (`waves`)."""
    key = (batch, kv_heads, max_context, num_sms, resident_per_sm, block_n)
    if contexts is not None and key in contexts.choices:
        return contexts.choices[key]
    capacity = max(1, num_sms * resident_per_sm)
    most = MAX_SPLITS if contexts is None else MAX_WORK_SPLITS
    cap = max(1, min(most, max_context // max(MIN_TOKENS_PER_SPLIT, block_n)))

    def cost(s: int) -> float:
        return waves(batch, kv_heads, capacity, s, contexts) * (max_context / s + PROGRAM_COST_TOKENS)
    best = min(range(1, cap + 1), key=lambda s: (cost(s), s))
    if contexts is not None:
        contexts.choices[key] = best
    return best


def resident_programs(n_regs: int, shared: int, num_warps: int, smem_per_sm: int) -> int:
    """Programs of a compiled kernel that fit on one SM at once (registers are allocated per warp in
    units of 256 from the register file of the warp's quarter of the SM, so 144 registers a thread
    hold 3 warps a quarter, 12 an SM, as 168 do; each program reserves 1 KB of shared memory beside
    its own)."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = SM_QUARTERS * (REGS_PER_SM // SM_QUARTERS // max(1, regs_per_warp)) // num_warps
    by_smem = smem_per_sm // (shared + 1024)
    by_threads = 2048 // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def slot_cost(batch: int, kv_heads: int, max_context: int, num_sms: int, resident: int, splits: int,
              contexts: BatchContexts | None = None) -> float:
    """Time of a decode launch bound by instruction issue (register-direct INT4), in token-times of
    one program alone: its waves, each as long as `resident` programs sharing an SM take (a variant
    that does not fit the GPU, `resident` 0, never wins)."""
    if resident <= 0:
        return math.inf
    n = waves(batch, kv_heads, max(1, num_sms * resident), splits, contexts)
    return n * resident * (max_context / splits + PROGRAM_COST_TOKENS)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


class Residency:
    """Programs per SM of each compiled decode variant, read once from its registers and shared
    memory (a variant is compiled before its first launch anyway); 0 where it does not fit this GPU
    at all (more shared memory than an SM has: a variant tuned on the H200, on a smaller GPU)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, int] = {}

    def get(self, key: tuple, device: torch.device, compile_variant) -> int:
        if key not in self._by_key:
            n = RESIDENT_DEFAULT
            if device.type == "cuda":
                from triton.runtime.errors import OutOfResources
                try:
                    kernel = compile_variant()
                    kernel._init_handles()
                    props = torch.cuda.get_device_properties(device)
                    n = resident_programs(kernel.n_regs, kernel.metadata.shared, kernel.metadata.num_warps,
                                          props.shared_memory_per_multiprocessor)
                except OutOfResources:
                    n = 0
                except Exception as e:  # an unknown Triton version: keep the default, say so once
                    logging.getLogger(__name__).warning("decode residency probe failed (%s: %s); assuming %d "
                                                        "programs per SM", type(e).__name__, e, n)
            self._by_key[key] = n
        return self._by_key[key]


RESIDENCY = Residency()


def resident_of(tag: str, kernel, args: dict, device: torch.device) -> int:
    """Programs per SM of `kernel` compiled for `args` (its partial-writing variant, the one that runs
    whenever splitting pays), read once per variant."""
    key = (tag, kernel) + tuple(v for n, v in args.items() if n.isupper() or n.startswith(("num_", "max"))) + (device,)
    one = torch.empty(1, dtype=torch.float32, device=device)  # warmup wraps only positional dtypes
    return RESIDENCY.get(key, device, lambda: kernel.warmup(**args, part_out_ptr=one, part_lse_ptr=one,
                                                            work_ptr=args["prefix_lens_ptr"], num_splits=2,
                                                            PARTIAL=True, grid=(1,)))


class SplitCounters:
    """Zeroed int32 counters, one per (sequence, KV head), for kernels whose last split reduces the
    others' partials: each split adds one, the last resets its counter to 0, so the buffer is zero
    between launches (and a CUDA graph can replay it). Allocated once per device."""

    SIZE = 1 << 16

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor | None:
        """The counters, or None where `n` (batch x KV heads) exceeds them."""
        if n > self.SIZE:
            return None
        if device not in self._by_device:
            self._by_device[device] = torch.zeros(self.SIZE, dtype=torch.int32, device=device)
        return self._by_device[device]


COUNTERS = SplitCounters()


def launch_split(kernel, out: torch.Tensor, kv_heads: int, splits: int, args: dict,
                 contexts: BatchContexts | None = None, fixed: WorkPlan | None = None) -> torch.Tensor:
    """Runs a decode kernel over (B, KV heads, splits) programs into out [B, H, D] (grid (KV heads, B,
    splits) where args HEADS_FIRST: the kernel reads its program ids that way); with more than one
    split each program writes a normalized partial and its log2-sum-exp, and `reduce_splits_kernel`
    combines them, unless the kernel's last split does (args FUSED). A ragged batch (`contexts`)
    whose work list pays runs one program per (unit, KV head) instead (`work_list.py`, WORK); so
    does a CUDA graph's fixed work list (`fixed`), always with partials and the second launch (its
    sequences' split counts change between replays)."""
    from kvmesh.kernels.partials import reduce_splits_kernel

    B, H, D = out.shape
    plan = contexts.plan(splits, out.device) if contexts is not None and contexts.pays(splits) else None
    if fixed is not None:
        plan, splits = fixed, max(splits, 2)  # (splits > 1: partials and the reduction)
        if "FUSED" in args:
            args = dict(args, FUSED=False)
    rows = (B, H, splits) if plan is None else (plan.units, H)  # partials of [B, H, splits] or [U, H]
    if splits > 1:
        part_out = torch.empty(*rows, D, dtype=torch.float32, device=out.device)
        part_lse = torch.empty(*rows, dtype=torch.float32, device=out.device)
    else:
        part_out = part_lse = out  # unused
    n, z = (B, splits) if plan is None else (plan.units, 1)  # the batch axis: sequences or units
    if n >= 65536 and args.get("HEADS_FIRST"):
        args = dict(args, HEADS_FIRST=False)  # the units go on x, which has room for them
    grid = (kv_heads, n, z) if args.get("HEADS_FIRST") else (n, kv_heads, z)  # y and z < 65,536
    work = plan.work if plan is not None else args["prefix_lens_ptr"]
    kernel[grid](**args, part_out_ptr=part_out, part_lse_ptr=part_lse, num_splits=splits, PARTIAL=splits > 1,
                 work_ptr=work, **({"WORK": True} if plan is not None else {}))
    if splits > 1 and not args.get("FUSED"):
        reduce_splits_kernel[(B, -(-H // REDUCE_HEADS))](
            part_out_ptr=part_out, part_lse_ptr=part_lse, out_ptr=out,
            stride_ot=out.stride(0), stride_oh=out.stride(1), seq_units_ptr=plan.seq_units if plan else work,
            H=H, SPLITS=splits, D=D, HB=REDUCE_HEADS, SB=REDUCE_SPLITS, WORK=plan is not None, num_warps=4)
    return out
