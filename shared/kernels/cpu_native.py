"""`NativeKernels`: the CPU serving path's small C library: decode attention straight from the
paged pool, the decode step's residual writes, and bf16 RMSNorm and RoPE.

Why: on the CPU, torch's decode attention over pages is bound by its copies, not its math. Per
layer it gathers every page of every sequence into a new tensor, converts it to float32 and runs
two batched matmuls of tiny matrices (SmolLM2 bf16, 32 sequences of ~110 tokens: ~1.1 ms a layer,
a third of a decode step). This kernel reads each key and value row where it lies (page, residual
slot, or the step's own new token), once, converts it in registers and keeps softmax and the
weighted sum in float32: two passes per (sequence, KV head), the R = H / KVH query heads of the
group sharing every loaded row. On AVX-512 CPUs head_dim 32 / 64 / 128 run a vectorized kernel
(`native_source.py`; SmolLM2 bf16, 32 sequences of ~107 tokens, one layer: 0.41 -> 0.25 ms, in
the model ~0.52 -> 0.40 ms, where the pages come from memory, not cache).

RMSNorm (bf16): torch's `rms_norm` numerics (float32 inside, one rounding to bf16 at the end;
transformers rounds twice, before and after the weight, which measured further from the fp32
model: SmolLM2's worst logit error 1.54 against 0.57) in one pass over the row, where torch runs
bf16 `rms_norm` as about eight ops (2048 x 576: ~3 ms; 32 rows: ~100 us in the model).

RoPE (bf16): q and k rotated in one pass, float32 inside, one rounding (torch: cat, neg, two
multiplies and an add, each rounding to bf16).

Scope of the attention kernel: one new token per sequence; unquantized KV pages (bf16 or fp32 storage, the model dtype);
other cases stay on `TorchBackend`'s torch path. The library is compiled once per machine with the
system C compiler (`cc`, about a second) into the kvmesh cache directory, and loaded with ctypes;
no compiler, a failed build or KVMESH_NATIVE_DECODE=0 means no kernel (`load()` returns None) and
the torch path runs. Math: the same softmax(q·kᵀ·scale)·v as the torch path in float32, summed in
another order (differences ~1e-6 relative); bf16 output rounded to nearest even like torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvmesh.kernels.native_source import SOURCE as _SOURCE

log = logging.getLogger(__name__)


# reassociation lets the compiler vectorize the dot products and sums; no -ffast-math (keeps
# inf / NaN semantics and expf exact to libm)
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast"]
_KINDS = {torch.float32: "kvmesh_decode_f32", torch.bfloat16: "kvmesh_decode_bf16"}
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _cache_dir() -> Path:
    env = os.environ.get("KVMESH_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh") / "native"


def _build() -> Path:
    """Compiles the library (once per source, flags and CPU) and returns its path."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    cpu = platform.processor() + platform.machine()
    try:
        with open("/proc/cpuinfo") as f:  # -march=native: the library is only good for this CPU
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, cpu]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"decode_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "decode.c"
        src.write_text(_SOURCE)
        lib = Path(tmp) / out.name
        r = subprocess.run([cc, *_FLAGS, str(src), "-o", str(lib), "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
        os.replace(lib, out)  # atomic: a concurrent build by another process is harmless
    return out


class NativeKernels:
    """The loaded kernel; `attend` runs it for one layer."""

    def __init__(self, lib: ctypes.CDLL, portable: bool = False) -> None:
        """portable: always the portable kernels (tests compare the two; by default AVX-512 CPUs
        take the vectorized ones where the shapes allow)."""
        pick = (lambda name: getattr(lib, name.replace("kvmesh_", "kvmesh_portable_"))) if portable else \
            (lambda name: getattr(lib, name))
        self._fns = {}
        for dtype, name in _KINDS.items():
            fn = pick(name)
            fn.restype = ctypes.c_int
            fn.argtypes = [_P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I,
                           ctypes.c_float, _I, _I, _I]
            self._fns[dtype] = fn
        self._norm = pick("kvmesh_rms_norm_bf16")
        self._norm.restype = None
        self._norm.argtypes = [_P, _I, _P, _P, _I, _I, ctypes.c_float]
        self._write = lib.kvmesh_residual_write
        self._write.restype = None
        self._write.argtypes = [_P, _P, _I, _I, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I]
        self._rope = pick("kvmesh_rope_bf16")
        self._rope.restype = None
        self._rope.argtypes = [_P, _I, _I, _P, _P, _P, _I, _I, _I]
        self._amx_init, self._amx_pack, self._amx_linear = lib.kvmesh_amx_init, lib.kvmesh_amx_pack, lib.kvmesh_amx_linear
        self._amx_init.restype = ctypes.c_int
        self._amx_init.argtypes = []
        self._amx_pack.restype = None
        self._amx_pack.argtypes = [_P, _I, _I, _P]
        self._amx_linear.restype = None
        self._amx_linear.argtypes = [_P, _I, _P, _P, _I, _I, _P, _I, _I, ctypes.c_int, _P, _I]
        self._amx_ok: bool | None = None
        # one decoder layer of a decode step (`native_decode_layer.py`); `model/native_decode.py`
        # builds its arguments
        self.decode_layer = lib.kvmesh_decode_layer
        self.decode_layer.restype = ctypes.c_int
        self.decode_layer.argtypes = ([_P, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_float] + [_P] * 10
                                      + [_I, _P, _P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P])
        self._argmax = {}
        for dtype, name in ((torch.float32, "kvmesh_argmax_f32"), (torch.bfloat16, "kvmesh_argmax_bf16")):
            fn = pick(name)
            fn.restype = None
            fn.argtypes = [_P, _I, _I, _I, _P]
            self._argmax[dtype] = fn

    def amx_ready(self) -> bool:
        """Whether the AMX linear runs here (built for AMX, and Linux granted the tile state)."""
        if self._amx_ok is None:
            self._amx_ok = self._amx_init() == 0
        return self._amx_ok

    def amx_pack(self, w: torch.Tensor) -> torch.Tensor:
        """w [N, K] bf16 -> its AMX tiles (bf16 [N * K]) for `amx_linear`; N % 32 == 0, K % 32 == 0."""
        N, K = w.shape
        if w.dtype != torch.bfloat16 or N % 32 or K % 32 or not self.amx_ready():
            raise ValueError(f"NativeKernels.amx_pack: wants bf16 [N, K] with N and K multiples of 32 on an "
                             f"AMX CPU, got {w.dtype} {tuple(w.shape)}")
        out = torch.empty(N * K, dtype=torch.bfloat16)
        self._amx_pack(w.contiguous().data_ptr(), N, K, out.data_ptr())
        return out

    def amx_linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                   op: int = 0, other: torch.Tensor | None = None) -> torch.Tensor:
        """op(x Wᵀ + bias) for W [n, K] packed by `amx_pack`: x [M, K] bf16 (rows may be strided);
        op 0: [M, n]; 1: + other [M, n] bf16 (rows may be strided); 2: silu(x Gᵀ) * (x Uᵀ) for
        W = [G; U], [M, n / 2]. The caller checks shapes (`PackedBf16Linear`: once, at packing)."""
        M, K = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty((M, n // 2 if op == 2 else n), dtype=torch.bfloat16)
        self._amx_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                         n, K, out.data_ptr(), out.stride(0), M, op,
                         None if other is None else other.data_ptr(), 0 if other is None else other.stride(0))
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [N, V] float32 or bf16 on the CPU (rows may be strided) -> int64 [N], the first index
        of each row's maximum, a NaN counting as the maximum (`torch.max(x, -1).indices`); None for
        other inputs (the caller runs torch). 32 x 49,152 bf16, one thread: 0.2 ms, where torch's
        max takes 1.8 (2.6 with the float32 copy the logits used to get first)."""
        fn = self._argmax.get(x.dtype)
        if fn is None or x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1 or x.shape[1] == 0:
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def residual_write(self, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, rk: torch.Tensor,
                       rv: torch.Tensor, slot: torch.Tensor, off: torch.Tensor) -> None:
        """rk/rv[slot[i], :, off[i]] = k/v[src[i]]: k, v [T, KVH, D] (token rows may be strided, heads
        dense), rk/rv [S, KVH, bs, D] of k's dtype (one layer's residual slots), src/slot/off int64 [m]."""
        T, KVH, D = k.shape
        bs = rk.shape[2]
        if (k.stride()[1:] != (D, 1) or v.stride()[1:] != (D, 1) or rk.dtype != k.dtype or v.dtype != k.dtype
                or rk.stride() != rv.stride() or rk.stride()[1:] != (bs * D, D, 1)):
            raise ValueError("NativeKernels.residual_write: wants dense [KVH, D] rows of one dtype")
        for t in (src, slot, off):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError("NativeKernels.residual_write: index tensors must be contiguous int64")
        self._write(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), rk.data_ptr(), rv.data_ptr(), rk.stride(0),
                    src.data_ptr(), slot.data_ptr(), off.data_ptr(), src.numel(), KVH, bs, D, k.element_size())

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] bf16 (rows may be strided, heads dense), cos/sin [T, 1, D] bf16 -> rotated
        [T, heads, D] (`RotaryEmbedding.apply`, one rounding)."""
        T, heads, D = x.shape
        if x.dtype != torch.bfloat16 or x.stride()[1:] != (D, 1) or cos.dtype != torch.bfloat16 or D % 2:
            raise ValueError(f"NativeKernels.rope: wants bf16 [T, heads, D] with dense heads, got {x.dtype} "
                             f"{tuple(x.shape)} strides {x.stride()}")
        c, s = cos.reshape(T, D).contiguous(), sin.reshape(T, D).contiguous()
        out = torch.empty((T, heads, D), dtype=x.dtype)
        self._rope(x.data_ptr(), x.stride(0), heads, c.data_ptr(), s.data_ptr(), out.data_ptr(), out.stride(0), T, D)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, dim] bf16 (rows may be strided), weight [dim] bf16 -> [T, dim] bf16."""
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"NativeKernels.rms_norm: wants bf16 [T, dim] rows, got {x.dtype} {tuple(x.shape)}")
        w = weight.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        self._norm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], float(eps))
        return out

    @staticmethod
    def supports(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether it runs a model of `dtype` over pages stored as `kv_dtype` (unquantized only)."""
        return dtype == kv_dtype and dtype in _KINDS

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kpages: torch.Tensor,
               vpages: torch.Tensor, table: torch.Tensor, nfull: torch.Tensor, rk: torch.Tensor,
               rv: torch.Tensor, slots: torch.Tensor, ntail: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [G, H, D], k/v [G, KVH, D] (this step's tokens; token rows may be strided, as slices
        of the fused qkv are); kpages/vpages [N, KVH, bs, D] (one layer's pages, rows may be
        strided); table int64 [G, >= max nfull]; nfull, ntail, slots int64 [G]; rk/rv
        [S, KVH, bs, D] (one layer's residual slots) -> out [G, H, D] (contiguous; given or new)."""
        G, H, D = q.shape
        KVH, bs = kpages.shape[1], kpages.shape[2]
        fn = self._fns[q.dtype]
        if q.stride()[1:] != (D, 1):
            q = q.contiguous()
        if k.stride()[1:] != (D, 1):
            k = k.contiguous()
        if v.stride()[1:] != (D, 1):
            v = v.contiguous()
        for t in (kpages, vpages, rk, rv):  # rows of [KVH, bs, D] must be dense
            if t.dtype != q.dtype or t.stride()[1:] != (bs * D, D, 1):
                raise ValueError(f"NativeKernels: cache view {tuple(t.shape)} {t.dtype} strides {t.stride()}")
        if kpages.stride(0) != vpages.stride(0) or rk.stride(0) != rv.stride(0):
            raise ValueError("NativeKernels: K and V views must share their page / slot strides")
        for t in (table, nfull, slots, ntail):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError("NativeKernels: index tensors must be contiguous int64")
        if out is None:
            out = torch.empty((G, H, D), dtype=q.dtype)
        elif out.shape != (G, H, D) or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"NativeKernels.attend: out must be contiguous {q.dtype} {(G, H, D)}")
        rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), kpages.data_ptr(), vpages.data_ptr(), kpages.stride(0),
                table.data_ptr(), table.stride(0) if table.dim() == 2 else 0, nfull.data_ptr(), rk.data_ptr(),
                rv.data_ptr(), rk.stride(0), slots.data_ptr(), ntail.data_ptr(), out.data_ptr(), G, H, KVH, bs, D,
                float(scale), q.stride(0), k.stride(0), v.stride(0))
        if rc == 2:
            raise ValueError(f"NativeKernels.attend: head_dim {D} > 512")
        if rc != 0:
            raise MemoryError("NativeKernels: out of memory for the score buffer")
        return out


@functools.lru_cache(maxsize=1)
def load() -> NativeKernels | None:
    """The kernel, built on first use; None where it cannot be (the torch path runs instead)."""
    if os.environ.get("KVMESH_NATIVE_DECODE", "1") == "0":
        return None
    try:
        return NativeKernels(ctypes.CDLL(str(_build())))
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("native CPU decode attention unavailable, using torch: %s", e)
        return None
