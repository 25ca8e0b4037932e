"""Probe (GPU): latency and throughput of mma.sync.m16n8k8 tf32 (the block-sparse kernel's
product) on this GPU, to tell a chain of dependent mma from the tensor pipe's rate.

    python -m benchmarks.probe_mma_latency --out mma.json

One warp a block runs C independent accumulator chains, each K mma long, interleaved in
program order; clock64 around the loop gives cycles per mma of a chain (C = 1: the dependent
latency) and, with many warps an SM, the issue interval per scheduler (the pipe's rate).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SRC = r"""
extern "C" __global__ void mma_chain(float* out, long long* cycles, int iters) {
  float c[CH][4];
  unsigned a0 = threadIdx.x * 0x3f800000u / 97u, a1 = a0 ^ 0x1234u, a2 = a0 ^ 0x55u, a3 = a0 ^ 0x777u;
  float b0 = __int_as_float(0x3f000000 + threadIdx.x), b1 = b0 * 0.5f;
  #pragma unroll
  for (int k = 0; k < CH; ++k) { c[k][0] = c[k][1] = c[k][2] = c[k][3] = 0.f; }
  __syncwarp();
  long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      #pragma unroll
      for (int k = 0; k < CH; ++k) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(__float_as_int(b0)), "r"(__float_as_int(b1)));
      }
    }
  }
  long long t1 = clock64();
  float s = 0.f;
  #pragma unroll
  for (int k = 0; k < CH; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
"""


def main(argv=None):
    import cupy as cp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args(argv)
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    rows = []
    for ch in (1, 2, 3, 4, 6, 8, 12):
        k = cp.RawKernel(SRC.replace("CH", str(ch)), "mma_chain", options=("-std=c++17",))
        for warps_per_sm in (1, 4, 8, 16):
            blocks = sms * warps_per_sm
            out = cp.zeros(blocks * 32, dtype=cp.float32)
            cyc = cp.zeros(blocks, dtype=cp.int64)
            k((blocks,), (32,), (out, cyc, cp.int32(10)))       # warm-up
            cp.cuda.Device().synchronize()
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            k((blocks,), (32,), (out, cyc, cp.int32(args.iters)))
            stop.record()
            stop.synchronize()
            ms = cp.cuda.get_elapsed_time(start, stop)
            n_mma = args.iters * 8 * ch
            per_warp = float(cp.median(cyc.astype(cp.float64))) / n_mma
            rows.append({"chains": ch, "warps_per_sm": warps_per_sm, "cycles_per_mma_of_a_warp": per_warp,
                         "cycles_per_chain_link": per_warp * ch, "ms": ms,
                         "mma_per_sm_per_us": n_mma * blocks / sms / (ms * 1e3)})
            print(json.dumps(rows[-1]), flush=True)
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
    res = {"device": name.decode() if isinstance(name, bytes) else str(name),
           "sms": sms, "rows": rows}
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
