#!/usr/bin/python3
# bench_torch_adamw.py: times PyTorch's CPU AdamW (torch.optim.AdamW, fp32 params, grads and
# moments) at 2^26 parameters with torch.set_num_threads(N), the baseline of
# tools/bench/compare_adam.sh. Times both of torch's implementations (foreach=False, the
# default in torch 1.13, and foreach=True) and reports the faster as "best".
# Not a correctness test (tests/runtime/test_cpu_adam.cpp compares with torch); run with
# Debian's /usr/bin/python3 (python3-torch).
import argparse
import json
import statistics
import sys
import time

import torch


def time_steps(opt, min_seconds, min_steps):
    opt.step()  # the first step allocates the moments: not timed
    opt.step()
    times = []
    start = time.perf_counter()
    while len(times) < min_steps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--log2", type=int, default=26, help="log2 of the parameter count")
    ap.add_argument("--threads", type=int, required=True, help="torch.set_num_threads")
    ap.add_argument("--min-seconds", type=float, default=3.0, help="time per variant")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if torch.get_num_threads() != args.threads:
        sys.exit(f"error: torch runs {torch.get_num_threads()} threads, asked for {args.threads}")
    n = 1 << args.log2
    gen = torch.Generator().manual_seed(0)
    results = {}
    for foreach in (False, True):
        p = torch.nn.Parameter(torch.rand(n, generator=gen) * 2 - 1)
        p.grad = (torch.rand(n, generator=gen) * 2 - 1) * 1e-3
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=foreach)
        times = time_steps(opt, args.min_seconds, 3)
        sec = statistics.median(times)
        name = "foreach" if foreach else "single_tensor"
        # Bytes the step must move (the same count as bench_cpu_adam's fused_fp32): read
        # grad, read+write param and both moments = 28 bytes per parameter.
        results[name] = {"seconds_per_step": sec, "steps_timed": len(times),
                         "gparams_per_s": n / sec / 1e9, "gbytes_per_s": 28 * n / sec / 1e9}
        print(f"torch AdamW {name:13s}: {sec * 1e3:8.1f} ms/step  "
              f"{n / sec / 1e9:.3f} Gparam/s  {28 * n / sec / 1e9:.2f} GB/s  "
              f"(median of {len(times)})")
        del opt, p
    best = min(results, key=lambda k: results[k]["seconds_per_step"])
    out = {"n": n, "threads": args.threads, "torch_version": torch.__version__,
           "variants": results, "best": best}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
