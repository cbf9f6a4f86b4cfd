"""This machine's matrix-product peak in fp32 (TF32 on CUDA, as ppo.py runs it) and bf16: the physical limit the
PPO benchmark's FLOP/s is held against.

Times `torch.matmul` (C = A @ B, A: (m, k), B: (k, n), 2*m*k*n FLOPs) for the matrix shapes one PPO minibatch of
SmolLM2-135M runs through (hidden 576, intermediate 1536, 3 KV heads x 64, vocab 49152; `--tokens` rows, default
8 rollouts x 56 tokens = one minibatch of the benchmark) and for one large square product, in fp32 and bf16, on the
CPU with `--threads` torch threads, or on the CUDA GPU (`--device cuda`; `--device all`: both).

Why both kinds of shape: the large square is the closest a matrix product gets to the hardware's peak (the
denominator of MFU); the model's own shapes say how much of it this workload's products can reach at all (small
k or n, like the 192-wide K/V projections, leave the units under-fed whatever the program around them does).

Each shape: warm-up, then repeated products until `--min_time_s` has passed (at least 3); the rate of the fastest
of `--rounds` such rounds is kept (others' load only ever slows a round down, so the fastest round is the best
estimate of the machine's own rate). Inputs are random normals (zeros run faster on some hardware).

Output: a table on stdout and a JSON (`--out`, default `benchmarks/results/peak_flops_<device>.json`):
  {"device", "device_name", "threads", "torch", "date", "shapes": [{name, m, k, n, dtype, tflops, s_per_product}],
   "peak_tflops": {"fp32": max over shapes, "bf16": ...}}
`peak_tflops` (the best rate seen over all shapes, in practice the large square) is what bench.py and
gpu_bench.py divide by. On a quiet machine it takes well under a minute on the CPU (seconds on a GPU).

Run:  python benchmarks/peak_flops.py                   # CPU, 2 threads, as the benchmark runs
      python benchmarks/peak_flops.py --device cuda     # the GPU
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json): hidden 576, intermediate 1536, 9 query heads and 3 KV
# heads of 64, vocab 49152.
HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB = 576, 1536, 3 * 64, 49152


def shapes(tokens, response_tokens, square):
    """(name, m, k, n) of the products: a decoder layer's projections on `tokens` rows, the LM head on the
    `response_tokens` rows ppo.py applies it to, and one `square`-sized product."""
    return [
        ("q_or_o_proj", tokens, HIDDEN, HIDDEN),
        ("k_or_v_proj", tokens, HIDDEN, KV_WIDTH),
        ("gate_or_up_proj", tokens, HIDDEN, INTERMEDIATE),
        ("down_proj", tokens, INTERMEDIATE, HIDDEN),
        ("lm_head", response_tokens, HIDDEN, VOCAB),
        (f"square_{square}", square, square, square),
    ]


def time_matmul(torch, device, dtype, m, k, n, min_time_s, rounds):
    """Best seconds per product of an (m, k) @ (k, n) matmul over `rounds` timed rounds."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):  # warm-up: kernel selection, caches, (CUDA) clocks ramping up
        torch.matmul(a, b, out=out)
    sync()
    best = float("inf")
    for _ in range(rounds):
        reps, t0 = 0, time.perf_counter()
        while True:
            torch.matmul(a, b, out=out)
            reps += 1
            if reps >= 3 and reps % 3 == 0:  # check the clock (a sync on CUDA) only every third product
                sync()
                elapsed = time.perf_counter() - t0
                if elapsed >= min_time_s:
                    break
        best = min(best, elapsed / reps)
    return best


def device_name(device):
    """The GPU's name (torch), or the CPU's model name (/proc/cpuinfo where there is one)."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            return names[0]
    return platform.processor() or platform.machine()


def measure(device="cpu", threads=2, tokens=448, response_tokens=192, square=None, min_time_s=0.25, rounds=3,
            dtypes=("fp32", "bf16"), verbose=True):
    """Run every shape in every dtype on `device`; return the JSON-able result (see the module docstring)."""
    import torch

    if device == "cpu":
        torch.set_num_threads(threads)
    square = square or (8192 if device == "cuda" else 2048)
    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    # fp32 products run as ppo.py's fp32 runs do: with TF32 on CUDA (`make_accelerator`), so the fp32 peak there is
    # TF32's, the denominator of a float32 run's MFU.
    name = device_name(device)
    rows = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = device == "cuda"
    for dtype in dtypes:
        for shape_name, m, k, n in shapes(tokens, response_tokens, square):
            s = time_matmul(torch, device, torch_dtypes[dtype], m, k, n, min_time_s, rounds)
            rows.append({"name": shape_name, "m": m, "k": k, "n": n, "dtype": dtype,
                         "tflops": round(2 * m * k * n / s / 1e12, 4), "s_per_product": s})
            if verbose:
                print(f"  {device} {dtype:4s} {shape_name:16s} ({m:5d} x {k:5d}) @ ({k:5d} x {n:5d}): "
                      f"{rows[-1]['tflops'] * 1e3:9.1f} GFLOP/s", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = tf32  # as the caller had it
    return {
        "device": device, "device_name": name, "threads": threads if device == "cpu" else None,
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "allow_tf32": True if device == "cuda" else None,
        "method": f"torch.matmul(out=) on random normals; best of {rounds} rounds of >= {min_time_s} s after 3 "
                  "warm-up products; FLOPs = 2*m*k*n",
        "shapes": rows,
        "peak_tflops": {d: max(r["tflops"] for r in rows if r["dtype"] == d) for d in dtypes},
    }


def default_out(device):
    return BENCH_DIR / "results" / f"peak_flops_{device}.json"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="cpu",
                    help="where to measure; `all`: the CPU and, if present, the GPU (one JSON each)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the benchmark's children use 2)")
    ap.add_argument("--tokens", type=int, default=448,
                    help="rows of the layer products: tokens of one PPO minibatch (8 rollouts x (32 + 24))")
    ap.add_argument("--response_tokens", type=int, default=192,
                    help="rows of the LM-head product: 8 rollouts x 24 response positions")
    ap.add_argument("--square", type=int, default=None, help="size of the large square product (CPU 2048, GPU 8192)")
    ap.add_argument("--min_time_s", type=float, default=0.25, help="least time of one timed round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per shape; the fastest counts")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/peak_flops_<device>.json; with --device all the "
                         "defaults are used, one per device)")
    args = ap.parse_args(argv)
    import torch

    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        if args.device == "cuda":
            raise SystemExit("--device cuda: torch sees no CUDA GPU")
        devices.remove("cuda")
    results = []
    for device in devices:
        result = measure(device, args.threads, args.tokens, args.response_tokens, args.square, args.min_time_s,
                         args.rounds)
        out = Path(args.out) if args.out and len(devices) == 1 else default_out(device)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"[peak_flops] {device} ({result['device_name']}): peak "
              + ", ".join(f"{d} {v:.3f} TFLOP/s" for d, v in result["peak_tflops"].items()) + f" -> {out}",
              flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
