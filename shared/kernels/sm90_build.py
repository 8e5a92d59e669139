"""An offline sm_90 build of the register-direct decode kernels (Gluon), and of the plain Triton decode
kernel for its launch choices: compiled through Triton's own ptxas for a Hopper target on a machine
without a GPU, disassembled with the cuobjdump its wheel carries. It gives what the chunk loop costs
(registers, stack, shared memory, SASS by opcode) at no device time, and lets CI on the CPU check that
the kernels still build under the installed Triton (the direct ones cannot run under its interpreter).
`benchmarks/sass.py` is its command line.

    python -m kvmesh.kernels.sm90_build   # JSON: each kernel at Llama-3-8B's and SmolLM2's heads
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kvmesh.kv.layout import BlockLayout

POINTERS = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "out_ptr": "*fp16", "part_out_ptr": "*fp32",
            "part_lse_ptr": "*fp32", "count_ptr": "*i32", "pool_ptr": "*u8", "res_ptr": "*fp16",
            "prefix_lens_ptr": "*i32", "block_tables_ptr": "*i32", "residual_slots_ptr": "*i32", "work_ptr": "*i32"}
FLOATS = {"qk_scale"}
UNALIGNED = {"num_splits", "g_rows"}


def _run(*cmd) -> str:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=True).stdout


def kernel_of(name: str):
    """(kernel, KV dtype, its constexprs as the engine launches it) for int4 | fp8_e4m3 | fp8_e5m2 | int8,
    or _<name> for a git-ignored INT4 experiment copy (as `int4_direct_check.py --variants mod_<name>`)."""
    if name == "int4" or name.startswith("_"):  # an experiment copy: kernels/_<name>_int4_direct.py
        mod = importlib.import_module(f"kvmesh.kernels.{'decode' if name == 'int4' else name}_int4_direct")
        return mod.decode_int4_direct_kernel, "int4", {"L2PF": True, "TAIL_FIRST": True, "L1NA": True,
                                                       "RING": getattr(mod, "RING", 0)}
    from kvmesh.kernels.decode_direct import CODE_MAX, FMT_CODES, LOADS, decode_direct_kernel
    fmt = FMT_CODES[name]
    lo = LOADS[fmt]  # as decode_direct() launches it
    return decode_direct_kernel, name, {"FMT": fmt, "CMAX": CODE_MAX[fmt], "KSEC": lo.k_sectors,
                                        "L2PF": lo.l2_prefetch, "HEADS_FIRST": lo.heads_first,
                                        "TAIL_FIRST": lo.tail_first, "L1NA": lo.l1_no_allocate}


def _source(kernel, consts: dict, bf16: bool, source_type):
    """`kernel` as a compile source: the constexprs given (the rest at their defaults), pointers typed as
    the launcher passes them (16-bit tensors bf16 for a bf16 model), ints divisible by 16 as it specializes
    pointers, strides and offsets."""
    names = kernel.arg_names
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in POINTERS:
            sig[n] = POINTERS[n].replace("fp16", "bf16") if bf16 and n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr",
                                                                           "res_ptr") else POINTERS[n]
        elif n in FLOATS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    const_values = {(names.index(n),): v for n, v in consts.items() if n in names}
    for p in kernel.params:  # declared constexprs left at their defaults
        if p.is_constexpr and p.name not in consts:
            sig[p.name] = "constexpr"
            const_values[(names.index(p.name),)] = p.default
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n not in FLOATS and n not in UNALIGNED}
    return source_type(kernel, sig, const_values, attrs)


def _build(src, options: dict) -> tuple[str, dict]:
    """(SASS text, {registers, stack, shared}) of a compile source built for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile

    compiled = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = _run(bindir / "cuobjdump", "-sass", f.name)
        usage = _run(bindir / "cuobjdump", "-res-usage", f.name)
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    meta = {"registers": int(regs.group(1)) if regs else -1, "stack": int(stack.group(1)) if stack else -1,
            "shared": compiled.metadata.shared}
    return sass, meta


def compile_sass(kernel, kv_dtype: str, d: int, g: int, bs: int, extra: dict, maxnreg: int | None,
                 partial: bool, bf16: bool) -> tuple[str, dict]:
    """(SASS text, {registers, stack, shared}) of `kernel` built for sm_90 at 8 KV heads, G query
    heads a KV head, head_dim d, block size bs; `partial`: split programs (partials, fused reduction)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    lay = BlockLayout(num_layers=1, kv_heads=8, head_dim=d, block_size=bs, kv_dtype=kv_dtype)
    if "NH" in kernel.arg_names:  # the 8-bit kernel's head columns, as decode_direct() picks them
        from kvmesh.kernels.decode_direct import head_columns
        extra = {"NH": head_columns(g), **extra}
    consts = dict(V_OFF=lay.v_data_offset, KS_OFF=lay.k_scale_offset, VS_OFF=lay.v_scale_offset, KVH=8, G=g,
                  BS=bs, D=d, PARTIAL=partial, FUSED=partial, BF16=bf16, RMAX=4, **extra)
    opts = {"num_warps": 1, **({"maxnreg": maxnreg} if maxnreg else {})}
    return _build(_source(kernel, consts, bf16, GluonASTSource), opts)


def compile_plain_sass(kv_dtype: str, d: int, g: int, bs: int, extra: dict, maxnreg: int | None, partial: bool,
                       bf16: bool, block_n: int | None = None, num_stages: int | None = None) -> tuple[str, dict]:
    """The plain Triton decode kernel with the constexprs and options `decode_attention` launches it with
    for `kv_dtype` pages (`plain_constexprs`; its format's tile unless given; `extra`: constexprs set on
    top, such as LO_ROWS), built for sm_90 like `compile_sass`."""
    from triton.compiler import ASTSource

    from kvmesh.kernels.decode_attention import decode_kernel
    from kvmesh.kernels.decode_tiles import plain_constexprs
    from kvmesh.kernels.formats import FMT_CODES
    from kvmesh.kernels.paged_attention import _dot_dtype

    lay = BlockLayout(num_layers=1, kv_heads=8, head_dim=d, block_size=bs, kv_dtype=kv_dtype)
    consts, _, _ = plain_constexprs(lay, g, _dot_dtype(FMT_CODES[kv_dtype], None), block_n=block_n,
                                    num_stages=num_stages, maxnreg=maxnreg)
    consts.update(PARTIAL=partial, **extra)
    opts = {k: consts.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in consts}
    return _build(_source(decode_kernel, consts, bf16, ASTSource), opts)


INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in INSTR.finditer(sass)]


def chunk_loop(ins: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The chunk loop: the smallest body of a backward branch that holds HMMA (the innermost loop
    with tensor-core work)."""
    best = []
    for addr, op, rest in ins:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", rest)
            if t and int(t.group(1), 16) < addr:
                body = [i for i in ins if int(t.group(1), 16) <= i[0] <= addr]
                if any(o.startswith("HMMA") for _, o, _ in body) and (not best or len(body) < len(best)):
                    best = body
    return best


# bytes of spills a case may take: int8's V loads as one L1::no_allocate pack (decode_direct.LOADS) spill 8
# bytes under the 128 cap (2 LDL a chunk), and still ran 1.5-2.9 % faster on the H200
SPILL_BUDGET = {("int8", 128, 4): 8}
# (kernel, head_dim, G, register cap) as the engine launches them: Llama-3-8B's heads, SmolLM2's, and
# 16 query heads a KV head (two MMA n-tiles; no cap)
CASES = [(k, 128, 4, 128) for k in ("int4", "fp8_e4m3", "fp8_e5m2", "int8")] + [
    ("int4", 64, 3, 128), ("int8", 64, 3, 128), ("fp8_e4m3", 128, 16, None), ("int8", 128, 16, None),
    ("int4", 128, 16, None)]


def build_report(cases=CASES, work: bool = False) -> list[dict]:
    """Each case's registers, spills, shared memory and chunk loop; `work`: the ragged batches' launch
    (units of a work list, `work_list.py`)."""
    report = []
    for name, d, g, cap in cases:
        kernel, kv_dtype, extra = kernel_of(name)
        if work:
            extra = {**extra, "WORK": True}
        sass, meta = compile_sass(kernel, kv_dtype, d, g, 16, extra, cap, True, False)
        loop = chunk_loop(instructions(sass))
        report.append({"kernel": name, "head_dim": d, "group": g, "cap": cap, **meta,
                       "loop": len(loop), "hmma": sum(op.startswith("HMMA") for _, op, _ in loop),
                       "wide_loads": sum(op.startswith("LDG") and ".128" in op for _, op, _ in loop)})
    return report


H200_SHARED_PER_SM = 233472  # bytes of shared memory an SM (228 KB)


def bf16_launches() -> dict:
    """Programs an H200 SM holds of each launch `decode_tiles.lo_rows_launch` picks from for bf16 pages
    (Llama-3-8B heads, a bf16 model, split programs): its choice rests on these."""
    from kvmesh.kernels.decode_tiles import TILES
    from kvmesh.kernels.formats import FMT_BF16
    from kvmesh.kernels.splits import resident_programs

    deep = TILES[FMT_BF16].lo_rows_deep_stages
    out = {}
    for name, extra, stages in (("two dots", {}, None), ("lo rows", {"LO_ROWS": True}, None),
                                ("lo rows deep", {"LO_ROWS": True}, deep)):
        _, meta = compile_plain_sass("bf16", 128, 4, 16, extra, None, True, True, num_stages=stages)
        out[name] = resident_programs(meta["registers"], meta["shared"], 4, H200_SHARED_PER_SM)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    json.dump(bf16_launches() if args == ["--bf16-launches"] else build_report(CASES[:4], work=True)
              if args == ["--work"] else build_report(), sys.stdout)
