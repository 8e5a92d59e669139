"""FP8 e4m3 (and INT4) KV levers on SmolLM2: a simulated paged cache, lever against lever on the same windows.

Each 1,024-token window runs through the model in ONE pass with an attention that sees, for a query
in block b (16-token blocks), what the real cache shows it when the window is fed in block-aligned
chunks of 16 (benchmarks/fidelity.py): blocks < b quantize-dequantized, its own block b in full
precision (the residual tail / the step's new rows). Causality makes the one pass equal to the
chunked run: a token's K/V depend only on earlier tokens, and a block is quantized from its own
tokens alone. A lever changes (a) which keys a query reads in full precision (`Lever.exact`),
(b) how a block is quantized (`Lever.k`, `Lever.v`) and (c) whether keys are first shifted by a
static calibrated center (`Lever.center`). Capacity is KV tokens per GiB against FP16 at
4,096-token sequences, counting pages, scales, extra per-block metadata and every full-precision
token a sequence keeps (in fp16, as on a GPU).

    OMP_NUM_THREADS=1 python benchmarks/kv_levers.py --windows 10       # screen every lever (~1 min each)
    OMP_NUM_THREADS=1 python benchmarks/kv_levers.py --windows 50 --levers fp32,fp8,K_center,K_center+sink4
    ... --calib-source code       # static key centers from other text than the one measured

Results and the reasoning behind them: docs/kv_cache.md, "FP8 levers (simulation)" and "INT4 keys
without m codes" (the int4 levers run kv/quant.py's real format, whose keys are symmetric since
then: `int4_K_center` is what the engine stores, `int4` the same keys uncentered).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from corpus import stdlib_docstrings  # noqa: E402

from kvmesh.kv.layout import BlockLayout, _align  # noqa: E402
from kvmesh.kv.quant import dequantize_blocks, quantize_blocks  # noqa: E402
from kvmesh.model.loader import load_model  # noqa: E402
from kvmesh.model.tokenizer import Tokenizer  # noqa: E402

E4M3 = torch.float8_e4m3fn
FMAX = 448.0
BS = 16  # block size (tokens)

# -- block quantizers: x float32 [n, KVH, bs, D] -> what dequantization returns, same shape ----------


def _absmax_scale(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """kvmesh.kv.quant's fp8 scale: absmax / 448 (true division), floored at 1e-6, stored fp32."""
    return x.abs().amax(dim=dims, keepdim=True).clamp(min=1e-6) / torch.tensor(FMAX)


def _e4m3(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Round x / s to e4m3 (saturating) and scale back."""
    return (x / s).clamp(-FMAX, FMAX).to(E4M3).float() * s


def q_fp8(x: torch.Tensor) -> torch.Tensor:
    """The shipped format: one fp32 scale per (block, head)."""
    return _e4m3(x, _absmax_scale(x, (2, 3)))


def q_fp8_mse(x: torch.Tensor, steps: int = 8) -> torch.Tensor:
    """Scale per (block, head) picked among absmax/448 · 2^(i/steps), i < steps, for the least
    squared error. e4m3's grid is periodic in log2, so these are all the distinct grids that do
    not clip (bar subnormals)."""
    s0 = _absmax_scale(x, (2, 3))  # [n, H, 1, 1]
    best, best_err = None, None
    for i in range(steps):
        y = _e4m3(x, s0 * 2.0 ** (i / steps))
        err = (y - x).pow(2).sum(dim=(2, 3), keepdim=True)  # [n, H, 1, 1]
        if best is None:
            best, best_err = y, err
        else:
            take = err < best_err
            best, best_err = torch.where(take, y, best), torch.minimum(err, best_err)
    return best


def q_fp8_chan(x: torch.Tensor) -> torch.Tensor:
    """One scale per (block, head, channel) over the block's 16 tokens, stored fp16."""
    s = (_absmax_scale(x, (2,))).to(torch.float16).float().clamp(min=2.0 ** -24)  # [n, H, 1, D]
    return _e4m3(x, s)


def q_fp8_tok(x: torch.Tensor) -> torch.Tensor:
    """One scale per (block, head, token), stored fp16 (placement only: e4m3 error is relative)."""
    s = (_absmax_scale(x, (3,))).to(torch.float16).float().clamp(min=2.0 ** -24)  # [n, H, bs, 1]
    return _e4m3(x, s)


def _mean_fp16(m: torch.Tensor) -> torch.Tensor:
    return m.to(torch.float16).float()


def _mean_fp8(m: torch.Tensor) -> torch.Tensor:
    """The channel mean in e4m3 with its own fp32 scale per (block, head)."""
    return _e4m3(m, _absmax_scale(m, (2, 3)))


def smoothed(round_mean: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """x ≈ m̂ + fp8(x - m̂): the per-(block, head) channel mean m̂ (stored rounded) is subtracted
    before fp8, so e4m3's relative error scales with the spread around it, not with |x|."""
    def q(x: torch.Tensor) -> torch.Tensor:
        m = round_mean(x.mean(dim=2, keepdim=True))  # [n, H, 1, D]
        return m + q_fp8(x - m)
    return q


def q_exact(x: torch.Tensor) -> torch.Tensor:
    return x


def _int4_shipped(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kvmesh's INT4 format (kv/quant.py) of x as K and as V: both dequantized, [n, H, bs, D]."""
    xt = x.transpose(1, 2).contiguous()  # [n, bs, H, D], quantize_blocks' order
    return dequantize_blocks(quantize_blocks(xt, xt, "int4"), "int4")


QUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exact": q_exact, "fp8": q_fp8, "fp8_mse": q_fp8_mse, "fp8_chan": q_fp8_chan, "fp8_tok": q_fp8_tok,
    "fp8_mean16": smoothed(_mean_fp16), "fp8_mean8": smoothed(_mean_fp8),
    "int4_k": lambda x: _int4_shipped(x)[0], "int4_v": lambda x: _int4_shipped(x)[1],
}


def extra_meta_bytes(kind: str, kvh: int, d: int) -> int:
    """Bytes one (block, layer) stores for K or V beyond fp8 data + one fp32 scale per head."""
    return {"exact": _align(kvh * BS * d * 2) - _align(kvh * BS * d) - _align(kvh * 4),  # fp16 data
            "fp8": 0, "fp8_mse": 0,
            "fp8_chan": _align(kvh * d * 2) - _align(kvh * 4),  # fp16 per channel replaces fp32 per head
            "fp8_tok": _align(kvh * BS * 2) - _align(kvh * 4),
            "fp8_mean16": _align(kvh * d * 2),
            "fp8_mean8": _align(kvh * d) + _align(kvh * 4)}[kind]


# -- levers -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lever:
    name: str
    k: str = "fp8"
    """Quantizer of key blocks (a QUANTIZERS name)."""
    v: str = "fp8"
    """Quantizer of value blocks."""
    sink: int = 0
    """First tokens of each sequence read in full precision by every query."""
    window: int = 0
    """Full blocks before the query's own block also read in full precision (0: the shipped tail)."""
    exact_layers: tuple[int, ...] = field(default=())
    """Layers whose K/V stay in full precision (fp16 pages)."""
    center: bool = False
    """Subtract a static per-(layer, KV head) channel mean from every key after RoPE (calibrated
    once on other text). Softmax ignores a shift shared by all keys of a query, so this costs no
    bytes and needs no add-back: only what fp8 rounds changes."""

    def exact(self, w: int) -> torch.Tensor:
        """bool [w, w]: query t reads key j in full precision (causality applied elsewhere)."""
        blk = torch.arange(w) // BS
        e = blk[None, :] >= blk[:, None] - self.window  # own block (+ window)
        return e | (torch.arange(w) < self.sink)[None, :]

    def capacity(self, layers: int, kvh: int, d: int, seq_len: int = 4096) -> float:
        """KV tokens per GiB against FP16 at `seq_len`-token sequences. Every full block is a page
        (pages are immutable and shareable); a full-precision copy of the window blocks rides in
        the residual slot, sink tokens in fp16 beside the sequence (a whole sink block replaces its
        fp8 page); exact layers are fp16 in the page."""
        if self.k == "exact" and self.v == "exact":
            return 1.0
        f16 = BlockLayout(layers, kvh, d, BS, "fp16")
        if self.k.startswith("int4"):  # the shipped INT4 page
            page = BlockLayout(layers, kvh, d, BS, "int4").block_bytes
        else:
            f8 = BlockLayout(layers, kvh, d, BS, "fp8_e4m3")
            page = (f8.block_bytes + layers * (extra_meta_bytes(self.k, kvh, d) + extra_meta_bytes(self.v, kvh, d))
                    + len(self.exact_layers) * (f16.layer_bytes - f8.layer_bytes))
        n = seq_len // BS
        sink_pages = self.sink // BS
        total = ((n - sink_pages) * page + sink_pages * f16.block_bytes + (self.sink % BS) * f16.block_bytes / BS
                 + (1 + self.window) * f16.block_bytes)  # residual tail + window copies
        return n * f16.block_bytes / total


def _levers() -> list[Lever]:
    L = Lever
    return [
        L("fp32", k="exact", v="exact"),
        L("fp8"),
        L("fp8 K only", v="exact"), L("fp8 V only", k="exact"),
        L("fp8+sink1", sink=1), L("fp8+sink4", sink=4), L("fp8+sink16", sink=16),
        L("fp8+win16", window=1), L("fp8+win32", window=2),
        L("K mean fp16", k="fp8_mean16"), L("K mean fp8", k="fp8_mean8"),
        L("K,V mean fp8", k="fp8_mean8", v="fp8_mean8"),
        L("mse scale", k="fp8_mse", v="fp8_mse"),
        L("K per-channel scale", k="fp8_chan"), L("K,V per-token scale", k="fp8_tok", v="fp8_tok"),
        L("layer 0 fp16", exact_layers=(0,)),
        L("K mean fp8+sink4", k="fp8_mean8", sink=4),
        L("K mean fp8+sink16", k="fp8_mean8", sink=16),
        L("K,V mean fp8+sink4", k="fp8_mean8", v="fp8_mean8", sink=4),
        L("K center", center=True), L("K center+sink4", center=True, sink=4),
        L("K center+sink16", center=True, sink=16),
        L("K center+K mean fp8", center=True, k="fp8_mean8"),
        L("K center+K per-token scale", center=True, k="fp8_tok"),
        L("K center+K per-token scale+sink16", center=True, k="fp8_tok", sink=16),
        # INT4: the shipped format (symmetric keys) uncentered, centered as the engine stores it, + a sink
        L("int4", k="int4_k", v="int4_v"), L("int4 K center", center=True, k="int4_k", v="int4_v"),
        L("int4 K center+sink4", center=True, k="int4_k", v="int4_v", sink=4),
    ]


LEVERS = {lv.name.replace(" ", "_"): lv for lv in _levers()}


# -- the simulated cache inside attention ------------------------------------------------------------


class SimBackend:
    """An attention backend for whole windows [B, W] fed as one flat batch: quantize-dequantize
    K/V in 16-token blocks and mix exact and quantized keys per (query, key) as `lever` says."""

    name = "sim"

    def __init__(self, lever: Lever, batch: int, w: int, centers: torch.Tensor | None = None) -> None:
        self.lever, self.b, self.w = lever, batch, w
        self.centers = centers  # [layers, KVH, D] or None
        e = lever.exact(w)  # [W, W]
        causal = torch.ones(w, w, dtype=torch.bool).tril()
        # keys = cat(quantized [W], exact [W]): each (query, key) pair is allowed in exactly one half
        allowed = torch.cat((causal & ~e, causal & e), dim=1)  # [W, 2W]
        self.mask = torch.zeros(2 * w, dtype=torch.float32).repeat(w, 1).masked_fill_(~allowed, float("-inf"))

    def _qdq(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """x: [B, W, KVH, D] -> same, every 16-token block quantize-dequantized."""
        B, W, H, D = x.shape
        blocks = x.float().view(B, W // BS, BS, H, D).transpose(2, 3).reshape(-1, H, BS, D)  # [n, H, bs, D]
        y = QUANTIZERS[kind](blocks)
        return y.view(B, W // BS, H, BS, D).transpose(2, 3).reshape(B, W, H, D)

    def attend(self, cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta, scale: float) -> torch.Tensor:
        B, W = self.b, self.w
        H, KVH, D = q.shape[1], k.shape[1], q.shape[2]
        Q = q.view(B, W, H, D).transpose(1, 2)  # [B, H, W, D]
        kk, vv = k.view(B, W, KVH, D), v.view(B, W, KVH, D)
        if self.lever.center:
            kk = kk - self.centers[layer]  # every key, exact ones too: the same scores up to a constant
        if layer in self.lever.exact_layers or (self.lever.k == "exact" and self.lever.v == "exact"):
            K, V, mask, causal = kk, vv, None, True
        else:
            K = torch.cat((self._qdq(kk, self.lever.k), kk), dim=1)  # [B, 2W, KVH, D]
            V = torch.cat((self._qdq(vv, self.lever.v), vv), dim=1)
            mask, causal = self.mask, False
        # enable_gqa: query head h reads KV head h // (H // KVH), as kvmesh's backends do
        out = F.scaled_dot_product_attention(Q, K.transpose(1, 2), V.transpose(1, 2), attn_mask=mask,
                                             is_causal=causal, scale=scale, enable_gqa=True)  # [B, H, W, D]
        return out.transpose(1, 2).reshape(B * W, H, D)

    def write(self, cache, layer, k, v, meta) -> None:
        return None  # nothing is kept: each window is one pass


class KeyMeanRecorder(SimBackend):
    """Full-precision attention that sums each layer's post-RoPE keys: the static key centers."""

    def __init__(self, batch: int, w: int, layers: int, kvh: int, d: int) -> None:
        super().__init__(Lever("fp32", k="exact", v="exact"), batch, w)
        self.sums = torch.zeros(layers, kvh, d, dtype=torch.float64)
        self.count = 0

    def attend(self, cache, layer, q, k, v, meta, scale):
        self.sums[layer] += k.double().sum(dim=0)
        self.count += k.shape[0] if layer == 0 else 0
        return super().attend(cache, layer, q, k, v, meta, scale)


def key_centers(model, cfg, win: torch.Tensor) -> torch.Tensor:
    """Mean post-RoPE key per (layer, KV head, channel) over windows [N, W], rounded to fp16 (what
    a shipped calibration file would hold): float32 [layers, KVH, D]."""
    rec = KeyMeanRecorder(1, win.shape[1], cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    for w in win:
        model(w, torch.arange(win.shape[1]), None, None, rec)
    return (rec.sums / rec.count).to(torch.float16).float()


def check_fp8_matches_kvmesh() -> None:
    """q_fp8 must be the shipped format's exact arithmetic."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, BS, 3, 64, generator=g) * torch.rand(8, 1, 3, 1, generator=g) * 10  # [n, bs, KVH, D]
    k, _ = dequantize_blocks(quantize_blocks(x, x, "fp8_e4m3"), "fp8_e4m3")  # [n, KVH, bs, D]
    if not torch.equal(k, q_fp8(x.transpose(1, 2).contiguous())):
        raise SystemExit("q_fp8 differs from kvmesh.kv.quant's fp8_e4m3")


CODE_MODULES = ("os", "ast", "tokenize", "calendar", "copy", "bisect", "gettext", "locale", "shlex", "glob")


def stdlib_source() -> str:
    """Raw source (code, comments, docstrings) of modules the evaluation corpus does not use: a
    calibration text from another domain than the docstrings measured."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / f"{m}.py").read_text(encoding="utf-8") for m in CODE_MODULES)


def nll(model, win: torch.Tensor, lever: Lever, batch: int,
        centers: torch.Tensor | None = None) -> tuple[float, int]:
    """Summed next-token NLL and count over windows [N, W]."""
    N, W = win.shape
    total, count = 0.0, 0
    for i in range(0, N, batch):
        w = win[i:i + batch]
        B = w.shape[0]
        backend = SimBackend(lever, B, W, centers)
        pos = torch.arange(W).repeat(B)
        hidden = model(w.reshape(-1), pos, None, None, backend).view(B, W, -1)
        for b in range(B):  # one window's logits at a time: [W, vocab] fp32 is 200 MB
            lp = torch.log_softmax(model.compute_logits(hidden[b, :-1]), dim=-1)
            total -= float(lp.gather(-1, w[b, 1:, None]).sum())
            count += W - 1
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--window-size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calib-windows", type=int, default=8,
                    help="windows of text for the static key centers")
    ap.add_argument("--calib-source", choices=("docstrings", "code"), default="docstrings",
                    help="docstrings: corpus text after the first 50 windows; code: other stdlib modules' source")
    ap.add_argument("--levers", default="all", help=f"comma list of: {', '.join(LEVERS)}")
    args = ap.parse_args()
    names = list(LEVERS) if args.levers == "all" else args.levers.split(",")
    unknown = [m for m in names if m not in LEVERS]
    if unknown:
        raise SystemExit(f"--levers: unknown {unknown}; choose from {', '.join(LEVERS)}")
    if names[0] != "fp32":
        names.insert(0, "fp32")  # the baseline every Δ is against
    torch.manual_seed(0)
    check_fp8_matches_kvmesh()

    tok = Tokenizer.from_model("smollm2")
    tokens = tok.encode(stdlib_docstrings(), add_special_tokens=False)
    n, W = args.windows, args.window_size
    need = max(n, 50) * W + args.calib_windows * W  # calibration text never overlaps 50 windows
    if len(tokens) < need:
        raise SystemExit(f"corpus has {len(tokens)} tokens, need {need}")
    win = torch.tensor(tokens[: n * W]).view(n, W)  # the windows benchmarks/fidelity.py uses
    calib = tokens[need - args.calib_windows * W: need]
    if args.calib_source == "code":
        calib = tok.encode(stdlib_source(), add_special_tokens=False)[: args.calib_windows * W]
    calib = torch.tensor(calib).view(args.calib_windows, W)
    model, cfg = load_model("smollm2", torch.float32, "cpu")
    model.pack_for_cpu()
    print(f"corpus: {win.numel()} tokens in {n} windows of {W}; block size {BS}; "
          f"threads {torch.get_num_threads()}", flush=True)

    centers = None
    if any(LEVERS[m].center for m in names):
        t0 = time.perf_counter()
        centers = key_centers(model, cfg, calib)
        print(f"key centers from {calib.numel()} tokens of {args.calib_source} ({time.perf_counter() - t0:.0f} s)", flush=True)
    ppl: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        t, c = nll(model, win, LEVERS[name], args.batch, centers)
        ppl[name] = math.exp(t / c)
        print(f"  {name:22s} perplexity {ppl[name]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    base = ppl["fp32"]
    print("\n| lever | perplexity | Δ vs fp32 KV | capacity vs fp16 (4,096-token seqs) | ≤ 0.5 % at ≥ 1.9× |")
    print("|---|---|---|---|---|")
    for name in names:
        lv = LEVERS[name]
        d = 100 * (ppl[name] / base - 1)
        cap = lv.capacity(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        ok = "yes" if d <= 0.5 and cap >= 1.9 else "no"
        print(f"| {lv.name} | {ppl[name]:.4f} | {d:+.2f} % | {cap:.3f}× | {'' if name == 'fp32' else ok} |")


if __name__ == "__main__":
    main()
