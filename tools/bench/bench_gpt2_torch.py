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
from gpt2_fixture import GPT2, REPO  # noqa: E402


class Llama(torch.nn.Module):
    """A LLaMA-family decoder as zero-run trains it (tools/fixtures/llama_fixture.py has the
    same math in float64, checked against by test_llama_reference): pre-RMSNorm blocks,
    grouped-query attention with rotary embeddings (default table), SwiGLU, an untied head."""

    def __init__(self, cfg):
        super().__init__()
        C, self.NH = cfg["hidden_size"], cfg["num_attention_heads"]
        self.KVH = cfg.get("num_key_value_heads", self.NH)
        self.HS = cfg.get("head_dim", C // self.NH)
        F, V, L = cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.F = F
        lin = lambda i, o, b=False: torch.nn.Linear(i, o, bias=b)
        bias = cfg.get("attention_bias", False) or cfg.get("model_type") == "qwen2"
        self.embed = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList()
        for _ in range(L):
            blk = torch.nn.Module()
            blk.n1 = torch.nn.Parameter(torch.ones(C))
            blk.qkv = lin(C, (self.NH + 2 * self.KVH) * self.HS, bias)
            blk.o = lin(self.NH * self.HS, C)
            blk.n2 = torch.nn.Parameter(torch.ones(C))
            blk.gate_up = lin(C, 2 * F)
            blk.down = lin(F, C)
            self.layers.append(blk)
        self.nf = torch.nn.Parameter(torch.ones(C))
        self.head = lin(C, V)
        self.theta = cfg.get("rope_theta", 10000.0)

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def forward(self, tokens, targets):
        B, T = tokens.shape
        NH, KVH, HS = self.NH, self.KVH, self.HS
        inv = 1.0 / (self.theta ** (torch.arange(0, HS, 2).float() / HS))
        ang = torch.arange(T).float()[:, None] * inv[None, :]
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        rot = lambda x: x * cos + torch.cat((-x[..., HS // 2:], x[..., :HS // 2]), -1) * sin
        x = self.embed(tokens)
        for blk in self.layers:
            qkv = blk.qkv(self.rms(x, blk.n1))
            q = rot(qkv[..., :NH * HS].view(B, T, NH, HS).transpose(1, 2))
            k = rot(qkv[..., NH * HS:(NH + KVH) * HS].view(B, T, KVH, HS).transpose(1, 2))
            v = qkv[..., (NH + KVH) * HS:].view(B, T, KVH, HS).transpose(1, 2)
            k, v = k.repeat_interleave(NH // KVH, 1), v.repeat_interleave(NH // KVH, 1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
            a = torch.softmax(s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")), -1)
            x = x + blk.o((a @ v).transpose(1, 2).reshape(B, T, NH * HS))
            g, u = blk.gate_up(self.rms(x, blk.n2)).split(self.F, -1)
            x = x + blk.down(torch.nn.functional.silu(g) * u)
        logits = self.head(self.rms(x, self.nf))
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def load_model(name):
    """A catalog name (models/configs) or a config.json path: GPT-2 or a LLaMA-family model."""
    path = name if name.endswith(".json") else os.path.join(REPO, "models", "configs", name + ".json")
    with open(path) as f:
        cfg = json.load(f)
    if cfg["model_type"] == "gpt2":
        return GPT2(cfg["n_embd"], cfg["n_head"], cfg["n_layer"], cfg["n_positions"], cfg["vocab_size"]), cfg["vocab_size"]
    if cfg["model_type"] in ("llama", "mistral", "qwen2"):
        return Llama(cfg), cfg["vocab_size"]
    sys.exit("bench_gpt2_torch: model_type %s is not benchmarked" % cfg["model_type"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="catalog name under models/configs, or a config.json (GPT-2 or LLaMA-family)")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--min-time", type=float, default=3.0, help="seconds of timed steps (at least 3 steps)")
    ap.add_argument("--optimizer", choices=["none", "adamw"], default="none",
                    help="adamw: add torch.optim.AdamW's step (a full training step)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(42)
    model, V = load_model(args.model)
    with torch.no_grad():  # the init scale of the C++ side: N(0, 0.02), norms 1, biases 0
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith("bias"):
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
