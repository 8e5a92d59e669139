"""The fused RMSNorm + linear + activation kernels (`kernels/norm_linear.py`) against the three
kernels they replace, side by side at decode batch sizes (H200).

    python3 benchmarks/norm_linear.py [--models smollm2,llama8b] [--rows 8,32,72,128,256] [--sweep]

Each row times one layer's half, in a CUDA graph of every layer's call in turn (each layer its own
weights, so they stream from memory as in a decode step; median of --reps replays):
- attention: F.rms_norm, the qkv GEMM (cuBLAS), RoPE (`kernels/rope.py`) against `norm_qkv_rope`;
- MLP: F.rms_norm, the gate/up GEMM (cuBLAS), the gated SiLU against `norm_gate_up`.
--chain also times whole layers as a decode step runs them (the attention's half, the o_proj GEMM
adding into the stream, the MLP's half, the down GEMM adding), unfused and fused. (A variant with
programmatic dependent launch ran 1.09-1.10x against fused's 1.11-1.12x, 2026-12-03, and is gone.)
--sweep also times every tile shape and prints the fastest beside the launcher's choice (models
whose hidden size the launcher fuses). The fused kernels run here at every hidden size, Llama-3-8B's
4,096 too, which the engine leaves to cuBLAS.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when needed; timing)

from kvmesh.kernels.gated_silu import gated_silu  # noqa: E402
from kvmesh.kernels.norm_linear import MAX_HIDDEN, ROPE, SILU, Tiles, _tiles, norm_gate_up, norm_qkv_rope  # noqa: E402
from kvmesh.model.rope import RotaryEmbedding  # noqa: E402

# hidden K, heads H, KV heads, head dim D, intermediate I, layers timed
MODELS = {"smollm2": (576, 9, 3, 64, 1536, 30), "smollm2-1.7b": (2048, 32, 32, 64, 8192, 24),
          "qwen2-1.5b": (1536, 12, 2, 128, 8960, 28), "llama8b": (4096, 32, 8, 128, 14336, 4)}


def _sweep(M: int, epilogue: int, half: int) -> list[Tiles]:
    top = max(16, min(64, triton.next_power_of_2(M)))
    shapes = [Tiles(bm, bn, bk) for bm, bn, bk in itertools.product((16, 32, 64), (16, 32, 64), (32, 64, 128))
              if bm <= top and (epilogue == SILU or bn <= half)]
    base = _tiles(M, epilogue, half)
    shapes += [Tiles(base.bm, base.bn, base.bk, w, s) for w, s in ((2, 3), (8, 3), (4, 2), (4, 4))]
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,smollm2-1.7b,qwen2-1.5b,llama8b")
    ap.add_argument("--rows", default="8,32,72,128,256")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--chain", action="store_true")
    a = ap.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}, {a.dtype}; us a layer (CUDA graph over the layers, median)")
    print("| model | rows | part | unfused us | fused us | unfused / fused | fastest tiles | its us |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        K, H, KVH, D, I, L = MODELS[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w_qkv = [torch.randn((H + 2 * KVH) * D, K, device=dev, dtype=dt, generator=g) / K ** 0.5 for _ in range(L)]
        w_gu = [torch.randn(2 * I, K, device=dev, dtype=dt, generator=g) / K ** 0.5 for _ in range(L)]
        norm_w = [1 + 0.1 * torch.randn(K, device=dev, dtype=dt, generator=g) for _ in range(L)]
        for M in (int(r) for r in a.rows.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dt, generator=g)
            cos, sin = RotaryEmbedding(D, 10000.0, None).cos_sin(torch.arange(M, device=dev) + 1000, dt)

            def attn_unfused():
                for i in range(L):
                    qkv = F.linear(F.rms_norm(x, (K,), norm_w[i], 1e-5), w_qkv[i]).view(M, H + 2 * KVH, D)
                    RotaryEmbedding.apply(qkv[:, :H + KVH], cos, sin)

            def attn_fused(t=None):
                for i in range(L):
                    norm_qkv_rope(x, norm_w[i], 1e-5, w_qkv[i], None, cos, sin, H, KVH, tiles=t)

            def mlp_unfused():
                for i in range(L):
                    gated_silu(F.linear(F.rms_norm(x, (K,), norm_w[i], 1e-5), w_gu[i]))

            def mlp_fused(t=None):
                for i in range(L):
                    norm_gate_up(x, norm_w[i], 1e-5, w_gu[i], tiles=t)

            if a.chain:
                _chain(a, name, M, x, norm_w, w_qkv, w_gu, cos, sin)
            for part, unfused, fused, epi, half in (("attention", attn_unfused, attn_fused, ROPE, D // 2),
                                                    ("MLP", mlp_unfused, mlp_fused, SILU, I)):
                t_un = kb.time_ms(unfused, a.reps, calls=1) * 1e3 / L
                t_fu = kb.time_ms(fused, a.reps, calls=1) * 1e3 / L
                best, t_best = _tiles(M, epi, half), t_fu
                if a.sweep and K <= MAX_HIDDEN:
                    for t in _sweep(M, epi, half):
                        try:
                            us = kb.time_ms(lambda t=t: fused(t), a.reps, calls=1) * 1e3 / L
                        except Exception as e:  # a tile shape past the SM's shared memory or registers
                            print(f"    ({t}: {type(e).__name__})", flush=True)
                            continue
                        if us < t_best:
                            best, t_best = t, us
                tiles = f"{best.bm}/{best.bn}/{best.bk} w{best.warps} s{best.stages}"
                print(f"| {name} | {M} | {part} | {t_un:.2f} | {t_fu:.2f} | {t_un / t_fu:.2f}x | {tiles} | "
                      f"{t_best:.2f} |", flush=True)


def _chain(a, name: str, M: int, x, norm_w, w_qkv, w_gu, cos, sin) -> None:
    """Whole layers: each half then its output GEMM adding into the stream (cuBLAS addmm_, as
    `model/llama._add_linear`), µs a layer, unfused and fused."""
    K, H, KVH, D, I, L = MODELS[name]
    dev, dt = x.device, x.dtype
    g = torch.Generator(device=dev).manual_seed(1)
    w_o = [torch.randn(K, H * D, device=dev, dtype=dt, generator=g) / (H * D) ** 0.5 / L for _ in range(L)]
    w_d = [torch.randn(K, I, device=dev, dtype=dt, generator=g) / I ** 0.5 / L for _ in range(L)]
    stream = x.clone()  # [M, K]: the residual stream the layers add into

    def layers(mode: str):
        for i in range(L):
            if mode == "unfused":
                qkv = F.linear(F.rms_norm(stream, (K,), norm_w[i], 1e-5), w_qkv[i]).view(M, H + 2 * KVH, D)
                q = RotaryEmbedding.apply(qkv[:, :H + KVH], cos, sin)[:, :H]
            else:
                t = Tiles(16, min(32, D // 2), stages=4)
                q = norm_qkv_rope(stream, norm_w[i], 1e-5, w_qkv[i], None, cos, sin, H, KVH, tiles=t)[:, :H]
            stream.addmm_(q.reshape(M, H * D), w_o[i].t())  # stands in for attention's output
            if mode == "unfused":
                h = gated_silu(F.linear(F.rms_norm(stream, (K,), norm_w[i], 1e-5), w_gu[i]))
            else:
                t = Tiles(16, 64 if M > 32 else 32, stages=3 if M > 32 else 4)
                h = norm_gate_up(stream, norm_w[i], 1e-5, w_gu[i], tiles=t)
            stream.addmm_(h, w_d[i].t())

    unfused, fused = (kb.time_ms(lambda m=m: layers(m), a.reps, calls=1) * 1e3 / L for m in ("unfused", "fused"))
    print(f"| {name} | {M} | whole layer | {unfused:.2f} | {fused:.2f} | {unfused / fused:.2f}x | | |", flush=True)


if __name__ == "__main__":
    main()
