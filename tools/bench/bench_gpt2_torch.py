#!/usr/bin/python3
"""bench_gpt2_torch.py: tokens/s of one GPT-2 forward + backward (no optimizer; with
--optimizer adamw, a whole training step) in PyTorch on the CPU, the baseline for bench_gpt2_cpu
(and for bench_engine with --optimizer adamw). Not a correctness test (test_gpt2_reference is); the model
is tools/fixtures/gpt2_fixture.py's, in fp32, with the same shape and thread count as the C++
run. tools/bench/compare_gpt2.sh runs both and prints the ratio.

    /usr/bin/python3 tools/bench/bench_gpt2_torch.py --model gpt2 --B 1 --T 256 --threads 2

Prints one JSON line: {"model":..,"B":..,"T":..,"threads":..,"step_ms":[..],"tokens_per_s":..}
with tokens_per_s from the median step.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures"))
from gpt2_fixture import GPT2, load_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="catalog name under models/configs")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--min-time", type=float, default=3.0, help="seconds of timed steps (at least 3 steps)")
    ap.add_argument("--optimizer", choices=["none", "adamw"], default="none",
                    help="adamw: add torch.optim.AdamW's step (a full training step)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    C, NH, L, P, V = load_config(args.model)
    torch.manual_seed(42)
    model = GPT2(C, NH, L, P, V)
    with torch.no_grad():  # GPT-2's init scale, as bench_gpt2_cpu
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    n = args.B * args.T
    tokens = (torch.arange(n) * 7919 % V).reshape(args.B, args.T)
    targets = ((torch.arange(n) * 104729 + 1) % V).reshape(args.B, args.T)

    opt = (torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
           if args.optimizer == "adamw" else None)

    def step():
        model.zero_grad(set_to_none=False)  # zero-filled gradients, as the C++ step
        _, loss = model(tokens, targets)
        loss.backward()
        if opt is not None:
            opt.step()
        return float(loss)

    loss0 = step()  # warm-up, and the answer: near ln V at this init
    if not abs(loss0 - math.log(V)) < 0.5:
        sys.exit("bench_gpt2_torch: wrong answer: loss %g, want about ln V = %.3f" % (loss0, math.log(V)))
    times = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < args.min_time:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    print(json.dumps({"model": args.model, "B": args.B, "T": args.T, "threads": args.threads,
                      "torch": torch.__version__, "loss0": loss0, "optimizer": args.optimizer,
                      "step_ms": [round(t * 1e3, 2) for t in times],
                      "tokens_per_s": n / median}))


if __name__ == "__main__":
    main()
