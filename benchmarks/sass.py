"""Compiles the register-direct decode kernels for sm_90 on a machine without a GPU and reports what
the chunk loop costs: registers, spills and the loop's SASS instructions by opcode. Iterate on
instruction counts here at no device time; time on the H200 (`kernels.py`, `int4_direct_check.py`).

    python3 benchmarks/sass.py                       # INT4 at Llama-3-8B heads (D 128, G 4), fp16
    python3 benchmarks/sass.py --kernel int4 --d 64 --g 3 --maxnreg 128 --dump /tmp/int4.sass
    python3 benchmarks/sass.py --kernel plain-bf16 --bf16 --maxnreg 0 --set LO_ROWS=True --stages 5

The loop is found as the smallest backward branch's body (`BRA` to an earlier label) that holds HMMA:
the chunk loop, one chunk per iteration."""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

from kvmesh.kernels.sm90_build import chunk_loop, compile_plain_sass, compile_sass, instructions, kernel_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default="int4",
                    help="int4 | fp8_e4m3 | fp8_e5m2 | int8, or plain-<kv dtype>: the plain Triton kernel")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--maxnreg", type=int, default=168)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--single", action="store_true", help="one split (no partials)")
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE: a constexpr of the kernel")
    ap.add_argument("--block-n", type=int, default=None, help="plain kernel: tokens a tile (default its format's)")
    ap.add_argument("--stages", type=int, default=None, help="plain kernel: pipeline depth (default its format's)")
    ap.add_argument("--dump", help="write the whole SASS here")
    a = ap.parse_args()
    plain = a.kernel.startswith("plain-")
    kernel, kv_dtype, extra = (None, a.kernel[len("plain-"):], {}) if plain else kernel_of(a.kernel)
    for kv in a.set:
        k, v = kv.split("=")
        extra[k] = int(v) if v.lstrip("-").isdigit() else {"True": True, "False": False}.get(v, v)
    if plain:
        sass, meta = compile_plain_sass(kv_dtype, a.d, a.g, a.bs, extra, a.maxnreg or None, not a.single, a.bf16,
                                        a.block_n, a.stages)
    else:
        sass, meta = compile_sass(kernel, kv_dtype, a.d, a.g, a.bs, extra, a.maxnreg or None, not a.single, a.bf16)
    if a.dump:
        Path(a.dump).write_text(sass)
    ins = instructions(sass)
    loop = chunk_loop(ins)
    hist = collections.Counter(op.split(".")[0] for _, op, _ in loop)
    print(f"{a.kernel} D {a.d} G {a.g} bs {a.bs} cap {a.maxnreg}: {meta['registers']} registers, "
          f"{meta['stack']} B stack, {meta['shared']} B shared; {len(ins)} instructions, loop {len(loop)}")
    print("  " + ", ".join(f"{op} {n}" for op, n in hist.most_common()))


if __name__ == "__main__":
    main()
