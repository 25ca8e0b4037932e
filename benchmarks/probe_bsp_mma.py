"""Probe (H200): the benchmark's block-sparse recurrence (bench_block_sparse FULL, `euler_matmul`)
on tensor cores, hand-written for that one program, to measure before the code generator gets it.

    python -m benchmarks.probe_bsp_mma --out probe.json [--ssmc]

Layout: a warp is 16 rows (the m of mma.m16n8k8) by the whole state; lane (g, q) = (lane / 4,
lane % 4) holds rows g and g + 8 at columns 8j + 2q and 8j + 2q + 1 of every 8-column block j,
which is both the accumulator layout of the mma and, with the columns of each block taken in the
order 0, 2, 4, 6, 1, 3, 5, 7, its A-operand layout: the state is never moved between lanes.
A step: A' = dt * h (a row scale), split into tf32 hi + lo; acc = h + B x; for each nonzero
block (j, k): acc_j += lo(A'_k) W_jk + hi(A'_k) lo(W_jk) + hi(A'_k) hi(W_jk) (3xTF32, fp32-accurate);
h = acc; y = sum h C (a quad shuffle). W's fragments in shared memory, a float4 per lane and block.
The step's loads are issued D steps ahead.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.bench_block_sparse import FULL, make_inputs, make_mask  # noqa: E402
from block_sparse_programs import euler_matmul  # noqa: E402


def source(tiles, n: int, warps: int, depth: int) -> str:
    nb = n // 8
    tj = ", ".join(str(j) for j, _ in tiles)
    tk = ", ".join(str(k) for _, k in tiles)
    ks = sorted({k for _, k in tiles})
    L = []
    add = L.append
    add(f"""#include <cuda_bf16.h>
#define NT {len(tiles)}
#define N {n}
#define NB {nb}
#define WARPS {warps}
#define D {depth}
#define HOIST {int(len(tiles) <= 16)}
__constant__ int TJ[NT] = {{ {tj} }};
__constant__ int TK[NT] = {{ {tk} }};
__device__ __forceinline__ unsigned tf32(float x) {{ unsigned r; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x)); return r; }}
__device__ __forceinline__ void mma(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, float b0, float b1) {{
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}}
__device__ __forceinline__ float4 lds4(const float4* p) {{
#if HOIST
  return *p;
#else
  float4 v; const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.volatile.shared.v4.f32 {{%0, %1, %2, %3}}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
  return v;
#endif
}}
__device__ __forceinline__ float bflo(unsigned w) {{ return __int_as_float(int(w << 16)); }}
__device__ __forceinline__ float bfhi(unsigned w) {{ return __int_as_float(int(w & 0xffff0000u)); }}
__device__ __forceinline__ float bf(unsigned short v) {{ return __int_as_float(int(unsigned(v) << 16)); }}

extern "C" __global__ void __launch_bounds__(WARPS * 32) bsp_mma(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ dt, const float* __restrict__ W,
    const unsigned short* __restrict__ Bm, const unsigned short* __restrict__ Cm, __nv_bfloat16* __restrict__ y,
    int b, int L, int d) {{
  __shared__ float4 Wf[NT][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  for (int i = threadIdx.x; i < NT * 32; i += blockDim.x) {{
    const int tt = i >> 5, l = i & 31, gg = l >> 2, qq = l & 3, j = TJ[tt], k = TK[tt];
    const float w0 = W[(8 * j + gg) * N + 8 * k + 2 * qq], w1 = W[(8 * j + gg) * N + 8 * k + 2 * qq + 1];
    const unsigned h0 = tf32(w0), h1 = tf32(w1);
    Wf[tt][l] = make_float4(__uint_as_float(h0), __uint_as_float(h1), w0 - __uint_as_float(h0), w1 - __uint_as_float(h1));
  }}
  __syncthreads();
  const long long tile = (long long)blockIdx.x * WARPS + warp;
  if (tile * 16 >= (long long)b * d) return;
  const long long r0 = tile * 16 + g;
  const int bi = int(r0 / d), d0 = int(r0 % d);
  const unsigned short* px = x + (long long)bi * L * d + d0;
  const unsigned short* pd = dt + (long long)bi * L * d + d0;
  const unsigned* pB = reinterpret_cast<const unsigned*>(Bm + (long long)bi * L * N + 2 * q);
  const unsigned* pC = reinterpret_cast<const unsigned*>(Cm + (long long)bi * L * N + 2 * q);
  __nv_bfloat16* py = y + (long long)bi * L * d + d0 + (q == 1 ? 8 : 0);
  float h[NB][4];
  #pragma unroll
  for (int j = 0; j < NB; ++j) h[j][0] = h[j][1] = h[j][2] = h[j][3] = 0.f;
  unsigned Bv[D][NB], Cv[D][NB];
  unsigned short xv[D][2], dv[D][2];
  #pragma unroll
  for (int u = 0; u < D; ++u) {{
    if (u < L) {{
      #pragma unroll
      for (int j = 0; j < NB; ++j) {{ Bv[u][j] = pB[4 * j]; Cv[u][j] = pC[4 * j]; }}
      xv[u][0] = px[0]; xv[u][1] = px[8]; dv[u][0] = pd[0]; dv[u][1] = pd[8];
    }}
    pB += N / 2; pC += N / 2; px += d; pd += d;
  }}
  for (int s0 = 0; s0 < L; s0 += D) {{
    #pragma unroll
    for (int u = 0; u < D; ++u) {{
      const int t = s0 + u;
      if (t >= L) break;
      const float dt0 = bf(dv[u][0]), dt1 = bf(dv[u][1]), x0 = bf(xv[u][0]), x1 = bf(xv[u][1]);
      float Bf[NB][2], Cf[NB][2];
      #pragma unroll
      for (int j = 0; j < NB; ++j) {{ Bf[j][0] = bflo(Bv[u][j]); Bf[j][1] = bfhi(Bv[u][j]);
                                    Cf[j][0] = bflo(Cv[u][j]); Cf[j][1] = bfhi(Cv[u][j]); }}
      if (t + D < L) {{   // the loads D steps ahead
        #pragma unroll
        for (int j = 0; j < NB; ++j) {{ Bv[u][j] = pB[4 * j]; Cv[u][j] = pC[4 * j]; }}
        xv[u][0] = px[0]; xv[u][1] = px[8]; dv[u][0] = pd[0]; dv[u][1] = pd[8];
      }}
      pB += N / 2; pC += N / 2; px += d; pd += d;""")
    add("      float acc[NB][4];")
    for j in range(nb):
        add(f"      acc[{j}][0] = fmaf(Bf[{j}][0], x0, h[{j}][0]); acc[{j}][1] = fmaf(Bf[{j}][1], x0, h[{j}][1]);"
            f" acc[{j}][2] = fmaf(Bf[{j}][0], x1, h[{j}][2]); acc[{j}][3] = fmaf(Bf[{j}][1], x1, h[{j}][3]);")
    for k in ks:      # per column block: A'_k = dt * h_k split into hi (the top 19 bits, exact in tf32) and
        # lo (the rest, exact in fp32; the mma reads its top 19 bits), then every block (j, k), small terms first
        add(f"      {{ const float v0 = dt0 * h[{k}][0], v1 = dt1 * h[{k}][2], v2 = dt0 * h[{k}][1], v3 = dt1 * h[{k}][3];")
        add("        unsigned ah[4], al[4];")
        for c in range(4):
            add(f"        ah[{c}] = __float_as_uint(v{c}) & 0xffffe000u; al[{c}] = __float_as_uint(v{c} - __uint_as_float(ah[{c}]));")
        for tt, (j, kk) in enumerate(tiles):
            if kk != k:
                continue
            add(f"        {{ const float4 w = lds4(&Wf[{tt}][lane]);")
            add(f"          mma(acc[{j}], al[0], al[1], al[2], al[3], w.x, w.y);")
            add(f"          mma(acc[{j}], ah[0], ah[1], ah[2], ah[3], w.z, w.w);")
            add(f"          mma(acc[{j}], ah[0], ah[1], ah[2], ah[3], w.x, w.y); }}")
        add("      }")
    add("""      float y0 = 0.f, y1 = 0.f;
      #pragma unroll
      for (int j = 0; j < NB; ++j) {
        h[j][0] = acc[j][0]; h[j][1] = acc[j][1]; h[j][2] = acc[j][2]; h[j][3] = acc[j][3];
        y0 = fmaf(h[j][0], Cf[j][0], fmaf(h[j][1], Cf[j][1], y0));
        y1 = fmaf(h[j][2], Cf[j][0], fmaf(h[j][3], Cf[j][1], y1));
      }
      y0 += __shfl_xor_sync(0xffffffffu, y0, 1); y1 += __shfl_xor_sync(0xffffffffu, y1, 1);
      y0 += __shfl_xor_sync(0xffffffffu, y0, 2); y1 += __shfl_xor_sync(0xffffffffu, y1, 2);
      if (q < 2) py[(long long)t * d] = __float2bfloat16_rn(q == 0 ? y0 : y1);
    }
  }
}""")
    return "\n".join(L)


def build(src: str, arch: int):
    import cupy
    from ssmc.targets.cuda import nvrtc_compile
    binary, fmt, _, _ = nvrtc_compile(src, arch, "bsp_mma.cu")
    mod = cupy.cuda.function.Module()
    mod.load(binary)
    return mod, mod.get_function("bsp_mma")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ssmc", action="store_true", help="also time ssmc's cuda kernel (sparse, dense) in the run")
    ap.add_argument("--compile-only", type=int, default=0, help="sm_XX: compile the variants, print registers")
    args = ap.parse_args(argv)
    cfg = FULL
    b, L, d, n, bs = cfg["b"], cfg["L"], cfg["d"], cfg["n"], cfg["bs"]
    gen = torch.Generator().manual_seed(0)
    sparse = make_mask(n, bs, cfg["density"], gen)
    masks = {"sparse": sparse, "dense": torch.ones(n, n)}
    variants = [(w, dp) for w in (1, 2, 4) for dp in (2, 4)]
    res = {"config": cfg, "rows": []}
    if args.compile_only:
        from ssmc.targets.cuda import nvrtc_compile
        for name, m in masks.items():
            tiles = [(j, k) for j in range(n // 8) for k in range(n // 8) if m[8 * j, 8 * k] > 0]
            for w, dp in variants:
                binary, fmt, _, log = nvrtc_compile(source(tiles, n, w, dp), args.compile_only, "bsp_mma.cu")
                print(name, w, dp, fmt, len(binary), log.strip()[:200])
        return res
    import cupy
    import numpy as np
    import triton.testing
    dev = torch.device("cuda")
    res["device"] = torch.cuda.get_device_name()
    arch = torch.cuda.get_device_capability()
    arch = arch[0] * 10 + arch[1]
    out = Path(args.out)
    for name, m in masks.items():
        tiles = [(j, k) for j in range(n // 8) for k in range(n // 8) if m[8 * j, 8 * k] > 0]
        chk = make_inputs(b=b, L=256, d=d, n=n, mask=m, dev=dev, gen=gen, seq_dtype=torch.bfloat16)
        ref = euler_matmul(*[t.double() for t in chk])
        full = make_inputs(b=b, L=L, d=d, n=n, mask=m, dev=dev, gen=gen, seq_dtype=torch.bfloat16)
        for w, dp in variants:
            row = {"mask": name, "tiles": len(tiles), "warps": w, "depth": dp}
            try:
                mod, fn = build(source(tiles, n, w, dp), arch)
                from cupy.cuda import driver
                row["regs"] = driver.funcGetAttribute(4, fn.ptr)          # CU_FUNC_ATTRIBUTE_NUM_REGS
                row["local_bytes"] = driver.funcGetAttribute(3, fn.ptr)   # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES

                def launch(ins, yb):
                    xx, dtt, A, mk, B, C = ins
                    Wm = (A * mk).float().contiguous()
                    bb, LL, dd = xx.shape
                    grid = (bb * dd // 16 + w - 1) // w
                    fn((grid, 1, 1), (32 * w, 1, 1),
                       tuple(np.uint64(t.data_ptr()) for t in (xx, dtt, Wm, B, C, yb)) + (np.int32(bb), np.int32(LL), np.int32(dd)),
                       stream=cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
                yb = torch.full_like(chk[0], float("nan"))
                launch(chk, yb)
                torch.cuda.synchronize()
                row["rel_err_vs_float64"] = ((yb.double() - ref).norm() / ref.norm()).item()
                yf = torch.empty_like(full[0])
                row["ms"] = triton.testing.do_bench(lambda: launch(full, yf), warmup=25, rep=100, return_mode="median")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            print(row, flush=True)
            res["rows"].append(row)
            out.write_text(json.dumps(res, indent=1))
    if args.ssmc:
        from benchmarks.bench_gpu import lowered_graph
        for name, m in masks.items():
            row = {"mask": name, "kernel": "ssmc cuda"}
            try:
                fn, _ = lowered_graph(euler_matmul, make_inputs(b=b, L=16, d=d, n=n, mask=m, dev=dev, gen=gen,
                                                                seq_dtype=torch.bfloat16), target="cuda")
                full = make_inputs(b=b, L=L, d=d, n=n, mask=m, dev=dev, gen=gen, seq_dtype=torch.bfloat16)
                row["ms"] = triton.testing.do_bench(lambda: fn(*full), warmup=25, rep=100, return_mode="median")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            print(row, flush=True)
            res["rows"].append(row)
            out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
