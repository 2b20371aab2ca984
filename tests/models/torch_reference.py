#!/usr/bin/env python3
# -----------------------------------------------------------------------------
# torch_reference.py -- independent PyTorch reference for the zeroplan planner.
#
# WHAT: small nn.Module re-implementations of Hugging Face transformers model
#   families (gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe,
#   gemma, gemma2, gemma3_text, phi, phi3, gpt_neox, opt, falcon, bloom, olmo2,
#   deepseek_v2, deepseek_v3, gpt_oss, t5, bert).  Parameter names, shapes,
#   registration order and block structure follow
#   huggingface/transformers src/transformers/models/<type>/modeling_<type>.py
#   (MoE experts use the per-expert names that Hub checkpoints store, see
#   "conventions" in the fixture).  For every configuration the script records
#     * the exact parameter inventory (HF names, shapes, numel, total), and
#     * every tensor autograd saves for backward during one training-mode
#       forward pass + mean cross-entropy loss (B=2, T=16; T5 decoder T=8),
#       captured with torch.autograd.graph.saved_tensors_hooks, attributed to
#       the innermost running module and labelled with the autograd node /
#       attribute that holds it, deduplicated by storage,
#   and, apart from the configs, the loss path (the LM head and HF's loss on
#   their own, fp32 and bf16): what autograd keeps and the gradients it makes
#   on the way back to the head ("loss_path"),
#   and writes tests/data/models/torch_reference.json.
#
# HOW TO RUN (Debian python3-torch 1.13, CPU, no transformers needed):
#   apt-get install -y --no-install-recommends python3-torch python3-numpy
#   /usr/bin/python3 tests/models/torch_reference.py            # all families
#   /usr/bin/python3 tests/models/torch_reference.py llama t5   # subset (does
#       not write the fixture unless --write is also given)
#   Deterministic (fixed seeds, single thread; byte-identical fixture on
#   re-run); the whole run takes about 3 s on one CPU core.
#
# INDEPENDENCE: nothing here reads or imports zeroplan's C++ code, its model
#   specs or its outputs.  The models were written from the HF modeling files
#   and config classes only; the saved-tensor numbers come from PyTorch's
#   autograd itself, not from any formula.  The C++ tests consume only the JSON.
# -----------------------------------------------------------------------------
import json
import math
import os
import re
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)

B, T = 2, 16
T5_DEC_T = 8

CONVENTIONS = {
    "dtype": "float32 everywhere (params, activations, loss)",
    "batch": {"B": B, "T": T, "t5_decoder_T": T5_DEC_T},
    "pass": "model.train(); one forward + F.cross_entropy(logits.view(-1,V), targets.view(-1), ignore_index=-100, reduction='mean') inside torch.autograd.graph.saved_tensors_hooks; causal-LM targets are HF's ForCausalLMLoss shift (labels padded with -100 then shifted by one) built outside the model; T5 takes decoder_input_ids and labels (B,8) directly, no shift; BERT takes labels as its heads do: (B,) classes for BertForSequenceClassification (CrossEntropyLoss on logits.view(-1,num_labels)), (B,T) masked-LM labels (-100 except every 4th position) for BertForMaskedLM, plus (B,) next_sentence_label for BertForPreTraining (the two losses added); BERT's position and token-type ids are slices of registered buffers, as in BertEmbeddings",
    "native_ops": "nn.Linear/F.linear, F.layer_norm, F.embedding, F.gelu/F.silu/F.relu, torch.softmax, torch.matmul, F.cross_entropy exactly where HF eager code uses them; HF eager attention (repeat_kv materialising GQA K/V, additive causal mask, softmax in fp32, dropout, matmul with V); GPT-2 Conv1D as torch.addmm with weight stored (in,out)",
    "custom_functions": {
        "RMSNorm": "fused autograd.Function: saves its input (and the weight, which is a parameter and therefore not listed) plus the fp32 per-row rstd of shape (...,1); Gemma-family (1+weight) variant, T5LayerNorm, Olmo2 full-width q_norm/k_norm and Qwen3/Gemma3 per-head q_norm/k_norm all use it",
        "rotary": "autograd.Function applied separately to q and k; saves nothing (cos/sin recomputed from positions in backward); partial rotary rotates the first rotary_dim channels of each head and concatenates the rest (phi, gpt_neox, phi3 with partial_rotary_factor); DeepSeek-V2 rotates interleaved pairs (complex form), DeepSeek-V3 with rope_interleave de-interleaves then rotate_half, exactly as HF's apply_rotary_emb / apply_rotary_pos_emb_interleave",
        "bloom_gelu": "HF's own GeLUFunction (autograd.Function saving its input), used by BloomGelu in training",
        "gradcheck": "each custom Function is checked with torch.autograd.gradcheck in float64 at startup",
    },
    "activations": "gelu_new (gpt2, phi, t5 gated-gelu) is HF's NewGELUActivation, i.e. Python composition 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x**3))) of native ops, so it saves several tensors; gelu_pytorch_tanh = F.gelu(approximate='tanh'); gelu = F.gelu; silu = F.silu; relu = F.relu",
    "dropout": "p=0 everywhere except config gpt2_dropout (resid/embd/attn_pdrop=0.1). F.dropout with p=0 returns its input and saves nothing. For p>0 we call torch.native_dropout (what F.dropout dispatches to on CUDA), which saves a bool mask; on CPU F.dropout would instead save a float32 noise tensor",
    "saved_tensors": "every tensor handed to the pack hook whose storage is not a parameter's storage; kind 'input' = storage of input_ids / decoder_input_ids / targets (excluded from totals); kind 'buffer' = storage of a registered module buffer (e.g. GPT-2's causal 'bias' mask, Gemma3 embed_scale; excluded from totals); kind 'scalar' = 0-dim float64 tensors, i.e. Python numbers wrapped by ops like `attn * scaling` (MulBackward0 saves them; on GPU they stay on the CPU; excluded from totals); kind 'act' = everything else. Storage bytes are counted once, attributed to the first tensor (in execution order) saved from that storage; later tensors from the same storage have counted_bytes 0",
    "module": "innermost module whose forward was running when the tensor was packed (forward pre/post hooks); '' = the top-level *ForCausalLM / ForConditionalGeneration (embedding-scale multiplies done inline, the loss)",
    "op": "autograd node name and saved attribute holding the tensor, found by walking the graph from the loss and unpacking each _saved_* field",
    "blocks": "per_block groups saved bytes by decoder block (regex in block_regex); everything else is outside_blocks",
    "moe_naming": "MoE experts use the per-expert names stored in Hub checkpoints and by transformers 4.x (mixtral: block_sparse_moe.experts.N.w1/w2/w3 + block_sparse_moe.gate; qwen2_moe/qwen3_moe/deepseek: mlp.experts.N.gate_proj/up_proj/down_proj + mlp.gate). transformers 5 fuses them at load time into experts.gate_up_proj (E,2I,H) and experts.down_proj (E,H,I) with the same numel. gpt_oss stores fused experts in the checkpoint and is named that way",
    "moe_routing": "routing is data-dependent; routing[] gives tokens per expert for every MoE layer of this run (expert loops skip experts with no tokens, so saved bytes depend on it). Expert weights are indexed with Python ints (views of the parameter); HF's GPT-OSS training loop indexes with a 1-element tensor, which would copy the expert's weight slice and save the copy",
    "params": "model.named_parameters() order (registration order; a module's own parameters come before its submodules', e.g. gpt_oss self_attn.sinks precedes q_proj exactly as in HF); tied weights listed once under the first name (gpt2 transformer.wte.weight, gemma/qwen3 model.embed_tokens.weight, opt model.decoder.embed_tokens.weight, falcon/bloom transformer.word_embeddings.weight, t5 shared.weight, which also covers encoder/decoder.embed_tokens); non-persistent buffers (rotary inv_freq, GPT-2 attn.bias) are not parameters",
    "moe_index_add": "HF's expert loops call index_add_; PyTorch's IndexAddBackward0 keeps `source` (the weighted expert output) as a saved tensor (derivatives.yaml uses expand_as(source)), so each expert saves one extra (tokens, hidden) tensor",
    "e_score_correction_bias": "deepseek_v3 router's e_score_correction_bias is a registered buffer in HF (not an nn.Parameter, no gradient; it is updated by the aux-loss-free balancing rule) but it IS stored in the checkpoint (model.layers.N.mlp.gate.e_score_correction_bias, fp32). It is NOT counted in params/total; it is listed in checkpoint_buffers and included in total_with_checkpoint_buffers",
}


# =============================================================================
# Custom autograd Functions
# =============================================================================
class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        cdt = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(cdt)
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        w = weight.to(cdt) + offset
        y = (xc * rstd * w).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        cdt = rstd.dtype
        xc = x.to(cdt)
        gc = g.to(cdt)
        xhat = xc * rstd
        w = weight.to(cdt) + ctx.offset
        dw = (gc * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        dxhat = gc * w
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, None, None


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_cos_sin(positions, inv_freq, scaling, dtype, style):
    # positions (B?,T) int; returns cos, sin broadcastable to (B,H,T,rd)
    cdt = torch.promote_types(dtype, torch.float32)
    freqs = positions.to(cdt)[..., None] * inv_freq.to(cdt)  # (b,T,rd/2)
    if style == "half":
        freqs = torch.cat((freqs, freqs), dim=-1)
    cos = (freqs.cos() * scaling).to(dtype)[:, None]
    sin = (freqs.sin() * scaling).to(dtype)[:, None]
    return cos, sin


def _deinterleave(x):  # (...,d) -> [x0,x2,..,x1,x3,..]
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(*x.shape[:-1], d)


def _reinterleave(x):  # inverse of _deinterleave
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], 2, d // 2).transpose(-1, -2).reshape(*x.shape[:-1], d)


class RotaryFn(torch.autograd.Function):
    """Applies RoPE to x (B,H,T,D) on its first rotary_dim channels. Saves nothing.

    style: 'half'  -> HF rotate_half form (x*cos + rotate_half(x)*sin)
           'pairs' -> DeepSeek-V2 complex form on interleaved pairs
           'deint' -> DeepSeek-V3 rope_interleave: de-interleave, then rotate_half
    cat_out: result produced by torch.cat (contiguous), as HF does for partial
             rotary, GPT-OSS's chunk form and DeepSeek-V2's view_as_real.
    """

    @staticmethod
    def forward(ctx, x, positions, inv_freq, rotary_dim, style, scaling, cat_out):
        ctx.positions, ctx.inv_freq = positions, inv_freq  # plain attributes, not saved tensors
        ctx.cfg = (rotary_dim, style, scaling)
        rd = rotary_dim
        xr = x[..., :rd]
        if style == "pairs":
            cos, sin = _rope_cos_sin(positions, inv_freq, scaling, x.dtype, "pairs")
            a, b = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            if style == "deint":
                xr = _deinterleave(xr)
            cos, sin = _rope_cos_sin(positions, inv_freq, scaling, x.dtype, "half")
            if cat_out or style == "deint":
                h = rd // 2
                x1, x2 = xr[..., :h], xr[..., h:]
                out = torch.cat((x1 * cos[..., :h] - x2 * sin[..., :h], x2 * cos[..., h:] + x1 * sin[..., h:]), dim=-1)
            else:
                out = (xr * cos) + (_rotate_half(xr) * sin)
        if rd < x.shape[-1]:
            out = torch.cat((out, x[..., rd:]), dim=-1)
        return out

    @staticmethod
    def backward(ctx, g):
        rd, style, scaling = ctx.cfg
        gr = g[..., :rd]
        if style == "pairs":
            cos, sin = _rope_cos_sin(ctx.positions, ctx.inv_freq, scaling, g.dtype, "pairs")
            g0, g1 = gr[..., 0::2], gr[..., 1::2]
            dx = torch.stack((g0 * cos + g1 * sin, -g0 * sin + g1 * cos), dim=-1).flatten(-2)
        else:
            cos, sin = _rope_cos_sin(ctx.positions, ctx.inv_freq, scaling, g.dtype, "half")
            dx = gr * cos - _rotate_half(gr * sin)
            if style == "deint":
                dx = _reinterleave(dx)
        if rd < g.shape[-1]:
            dx = torch.cat((dx, g[..., rd:]), dim=-1)
        return dx, None, None, None, None, None, None


class Rope:
    """Holds inv_freq for a rotary variant (HF *RotaryEmbedding, default rope type)."""

    def __init__(self, rotary_dim, base, style="half", scaling=1.0, cat_out=False):
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        self.style, self.scaling, self.cat_out = style, scaling, cat_out

    def __call__(self, x, positions):
        return RotaryFn.apply(x, positions, self.inv_freq, self.rotary_dim, self.style, self.scaling, self.cat_out)


class BloomGeLUFunction(torch.autograd.Function):
    # HF modeling_bloom.GeLUFunction
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * g


def gradcheck_custom_functions():
    torch.manual_seed(0)
    d = torch.float64
    for offset in (0.0, 1.0):
        x = torch.randn(2, 3, 8, dtype=d, requires_grad=True)
        w = torch.randn(8, dtype=d, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a, b: RMSNormFn.apply(a, b, 1e-6, offset), (x, w))
    pos = torch.arange(5)[None]
    for style, rd, cat_out in (("half", 8, False), ("half", 4, True), ("half", 8, True), ("pairs", 8, True), ("deint", 8, True), ("half", 6, False)):
        x = torch.randn(2, 5, 3, 8, dtype=d).transpose(1, 2).requires_grad_(True)  # non-contiguous like HF
        inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).double() / rd))
        assert torch.autograd.gradcheck(lambda a: RotaryFn.apply(a, pos, inv, rd, style, 1.0, cat_out), (x,))
    # rotary forward agrees with HF's formulas
    q = torch.randn(2, 3, 5, 8, dtype=d)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    fr = pos[..., None].double() * inv
    emb = torch.cat((fr, fr), -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    ref = q * cos + _rotate_half(q) * sin
    assert torch.allclose(RotaryFn.apply(q, pos, inv, 8, "half", 1.0, False), ref)
    ref_int = _deinterleave(q) * cos + _rotate_half(_deinterleave(q)) * sin
    assert torch.allclose(RotaryFn.apply(q, pos, inv, 8, "deint", 1.0, True), ref_int)
    qc = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2).contiguous())
    ref_c = torch.view_as_real(qc * torch.polar(torch.ones_like(fr), fr)[:, None]).flatten(3)
    assert torch.allclose(RotaryFn.apply(q, pos, inv, 8, "pairs", 1.0, True), ref_c)
    x = torch.randn(3, 7, dtype=d, requires_grad=True)
    assert torch.autograd.gradcheck(BloomGeLUFunction.apply, (x,), atol=1e-5)
    return ["RMSNormFn(offset 0,1)", "RotaryFn(half,partial,cat,pairs,deint)", "BloomGeLUFunction"]


# =============================================================================
# Shared building blocks (HF semantics)
# =============================================================================
def new_gelu(x):  # HF NewGELUActivation ("gelu_new")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACT = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": new_gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def dropout(x, p, training):
    if not training or p == 0.0:
        return F.dropout(x, p, training)  # identity, saves nothing
    return torch.native_dropout(x, p, True)[0]  # CUDA path of F.dropout: saves a bool mask


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, offset=0.0):
        super().__init__()
        # Gemma-style norms store weight-1 (init zeros) and apply (1 + weight)
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        return RMSNormFn.apply(x, self.weight, self.eps, self.offset)


class Conv1D(nn.Module):  # HF pytorch_utils.Conv1D
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention(q, k, v, mask, scaling, p_drop, training, softcap=None):
    """HF eager_attention_forward (llama & co.; gemma2/3 softcap variant)."""
    n_rep = q.shape[1] // k.shape[1]
    k = repeat_kv(k, n_rep)
    v = repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        w = w / softcap
        w = torch.tanh(w)
        w = w * softcap
    if mask is not None:
        w = w + mask[:, :, :, : k.shape[-2]]
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = dropout(w, p_drop, training)
    out = torch.matmul(w, v)
    return out.transpose(1, 2).contiguous()


def causal_mask(t, dtype=torch.float32, sliding_window=None):
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed = allowed & (i - j < sliding_window)
    m = torch.zeros(t, t, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return m[None, None]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) -- LlamaMLP & friends. names = (gate, up, down) attribute names,
    registered in `order`."""

    def __init__(self, h, i, act, bias=False, names=("gate_proj", "up_proj", "down_proj"), order=None):
        super().__init__()
        self._names = names
        dims = {names[0]: (h, i), names[1]: (h, i), names[2]: (i, h)}
        for n in order or names:
            setattr(self, n, nn.Linear(*dims[n], bias=bias))
        self.act = ACT[act]

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self._names)
        return d(self.act(g(x)) * u(x))


ROUTING = []


def _record_routing(module, counts):
    ROUTING.append({"module": getattr(module, "_hf_name", "?"), "tokens_per_expert": [int(c) for c in counts]})


# =============================================================================
# Llama-style decoders: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
# qwen3_moe, gemma, gemma2, gemma3_text, olmo2, gpt_oss
# =============================================================================
class LlamaStyleAttention(nn.Module):
    def __init__(self, c, layer_idx, kind):
        super().__init__()
        H = c["hidden_size"]
        nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        hd = c.get("head_dim") or H // nh
        self.nh, self.nkv, self.hd, self.kind = nh, nkv, hd, kind
        if kind in ("qwen2", "qwen2_moe"):
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(c.get("attention_bias", False))
        self.q_proj = nn.Linear(H, nh * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(H, nkv * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(H, nkv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=o_bias)
        eps = c.get("rms_norm_eps", 1e-6)
        self.qk_norm = None
        if kind in ("qwen3", "qwen3_moe"):
            self.q_norm, self.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
            self.qk_norm = "head"
        elif kind == "gemma3_text":
            self.q_norm, self.k_norm = RMSNorm(hd, eps, 1.0), RMSNorm(hd, eps, 1.0)
            self.qk_norm = "head"
        elif kind == "olmo2":
            self.q_norm, self.k_norm = RMSNorm(nh * hd, eps), RMSNorm(nkv * hd, eps)
            self.qk_norm = "full"
        if kind == "gpt_oss":
            self.sinks = nn.Parameter(torch.empty(nh))
        self.scaling = (c["query_pre_attn_scalar"] ** -0.5) if kind in ("gemma2", "gemma3_text") else hd ** -0.5
        self.softcap = c.get("attn_logit_softcapping") if kind in ("gemma2", "gemma3_text") else None
        self.p_drop = c.get("attention_dropout", 0.0)
        lt = c.get("layer_types")
        self.sliding = bool(lt and lt[layer_idx] == "sliding_attention")
        base = c.get("rope_theta", 10000.0)
        if kind == "gemma3_text" and self.sliding:
            base = c["rope_local_base_freq"]
        self.rope = Rope(hd, base, "half", cat_out=(kind == "gpt_oss"))

    def forward(self, x, masks, pos):
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":  # olmo2: norm over the whole projection, then split heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(b, t, -1, self.hd), k.view(b, t, -1, self.hd), v.view(b, t, -1, self.hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rope(q, pos), self.rope(k, pos)
        mask = masks["sliding"] if self.sliding else masks["full"]
        if self.kind == "gpt_oss":
            o = self._gpt_oss_eager(q, k, v, mask)
        else:
            o = eager_attention(q, k, v, mask, self.scaling, self.p_drop, self.training, self.softcap)
        return self.o_proj(o.reshape(b, t, -1).contiguous())

    def _gpt_oss_eager(self, q, k, v, mask):  # modeling_gpt_oss.eager_attention_forward
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        w = w + mask[:, :, :, : k.shape[-2]]
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        comb = torch.cat([w, sinks], dim=-1)
        comb = comb - comb.max(dim=-1, keepdim=True).values
        probs = F.softmax(comb, dim=-1, dtype=comb.dtype)
        scores = probs[..., :-1]
        w = dropout(scores, self.p_drop, self.training)
        out = torch.matmul(w, v)
        return out.transpose(1, 2).contiguous()


class MixtralExpert(nn.Module):  # MixtralBlockSparseTop2MLP: w1 (gate), w2 (down), w3 (up)
    def __init__(self, c):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)
        self.act = ACT[c["hidden_act"]]

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class SoftmaxTopKMoE(nn.Module):
    """MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock (transformers 4.x)."""

    def __init__(self, c, kind):
        super().__init__()
        H = c["hidden_size"]
        if kind == "mixtral":
            E = c["num_local_experts"]
            self.gate = nn.Linear(H, E, bias=False)
            self.experts = nn.ModuleList([MixtralExpert(c) for _ in range(E)])
            self.norm_topk = True
        else:
            E = c["num_experts"]
            self.gate = nn.Linear(H, E, bias=False)
            self.experts = nn.ModuleList([GatedMLP(H, c["moe_intermediate_size"], c["hidden_act"]) for _ in range(E)])
            self.norm_topk = bool(c.get("norm_topk_prob", False))
            if kind == "qwen2_moe":
                self.shared_expert = GatedMLP(H, c["shared_expert_intermediate_size"], c["hidden_act"])
                self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self.kind, self.E, self.top_k = kind, E, c["num_experts_per_tok"]

    def forward(self, x):
        b, t, h = x.shape
        x = x.view(-1, h)
        router_logits = self.gate(x)
        rw = F.softmax(router_logits, dim=1, dtype=torch.float)
        rw, sel = torch.topk(rw, self.top_k, dim=-1)
        if self.norm_topk:
            rw /= rw.sum(dim=-1, keepdim=True)
        rw = rw.to(x.dtype)
        final = torch.zeros((b * t, h), dtype=x.dtype)
        expert_mask = F.one_hot(sel, num_classes=self.E).permute(2, 1, 0)
        _record_routing(self, expert_mask.sum(dim=(1, 2)).tolist())
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            idx, top_x = torch.where(expert_mask[e])
            cur = x[None, top_x].reshape(-1, h)
            cur = self.experts[e](cur) * rw[top_x, idx, None]
            final.index_add_(0, top_x, cur.to(x.dtype))
        if self.kind == "qwen2_moe":
            sh = self.shared_expert(x)
            sh = torch.sigmoid(self.shared_expert_gate(x)) * sh
            final = final + sh
        return final.reshape(b, t, h)


class GptOssExperts(nn.Module):
    def __init__(self, c):
        super().__init__()
        E, H, I = c["num_local_experts"], c["hidden_size"], c["intermediate_size"]
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        self.alpha, self.limit, self.H = 1.702, c.get("swiglu_limit", 7.0), H

    def forward(self, x, router_indices, routing_weights):  # training branch of HF forward
        b = x.shape[0]
        x = x.reshape(-1, self.H)
        E = routing_weights.shape[1]
        nxt = torch.zeros_like(x)
        with torch.no_grad():
            expert_mask = F.one_hot(router_indices, num_classes=E).permute(2, 1, 0)
            _record_routing(self, expert_mask.sum(dim=(1, 2)).tolist())
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            with torch.no_grad():
                _, token_idx = torch.where(expert_mask[e])
            cur = x[token_idx]
            gate_up = cur @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            out = ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]
            weighted = out * routing_weights[token_idx, e, None]
            nxt.index_add_(0, token_idx, weighted.to(x.dtype))
        return nxt.view(b, -1, self.H)


class GptOssTopKRouter(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.top_k, self.H = c["num_experts_per_tok"], c["hidden_size"]
        self.weight = nn.Parameter(torch.empty(c["num_local_experts"], c["hidden_size"]))
        self.bias = nn.Parameter(torch.empty(c["num_local_experts"]))

    def forward(self, x):
        x = x.reshape(-1, self.H)
        logits = F.linear(x, self.weight, self.bias)
        top_v, top_i = torch.topk(logits, self.top_k, dim=-1)
        top_v = F.softmax(top_v, dim=1, dtype=top_v.dtype)
        scores = torch.zeros_like(logits).scatter_(1, top_i, top_v)
        return scores, top_i


class GptOssMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.router = GptOssTopKRouter(c)
        self.experts = GptOssExperts(c)

    def forward(self, x):
        scores, idx = self.router(x)
        return self.experts(x, router_indices=idx, routing_weights=scores)


class LlamaStyleLayer(nn.Module):
    def __init__(self, c, i, kind):
        super().__init__()
        H, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-6)
        self.kind = kind
        self.self_attn = LlamaStyleAttention(c, i, kind)
        gemma = kind in ("gemma", "gemma2", "gemma3_text")
        act = c.get("hidden_activation") or c["hidden_act"] if gemma else c.get("hidden_act")
        if kind == "mixtral":
            self.block_sparse_moe = SoftmaxTopKMoE(c, kind)
        elif kind in ("qwen2_moe", "qwen3_moe"):
            sparse = (i not in c.get("mlp_only_layers", [])) and c["num_experts"] > 0 and (i + 1) % c["decoder_sparse_step"] == 0
            self.mlp = SoftmaxTopKMoE(c, kind) if sparse else GatedMLP(H, c["intermediate_size"], act)
        elif kind == "gpt_oss":
            self.mlp = GptOssMLP(c)
        else:
            self.mlp = GatedMLP(H, c["intermediate_size"], act, bias=bool(c.get("mlp_bias", False)))
        off = 1.0 if gemma else 0.0
        if kind != "olmo2":
            self.input_layernorm = RMSNorm(H, eps, off)
        self.post_attention_layernorm = RMSNorm(H, eps, off)
        if kind in ("gemma2", "gemma3_text"):
            self.pre_feedforward_layernorm = RMSNorm(H, eps, off)
            self.post_feedforward_layernorm = RMSNorm(H, eps, off)
        if kind == "olmo2":
            self.post_feedforward_layernorm = RMSNorm(H, eps)

    def forward(self, x, masks, pos):
        ffn = self.block_sparse_moe if self.kind == "mixtral" else self.mlp
        if self.kind == "olmo2":
            x = x + self.post_attention_layernorm(self.self_attn(x, masks, pos))
            return x + self.post_feedforward_layernorm(ffn(x))
        if self.kind in ("gemma2", "gemma3_text"):
            h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), masks, pos))
            x = x + h
            h = self.post_feedforward_layernorm(ffn(self.pre_feedforward_layernorm(x)))
            return x + h
        x = x + self.self_attn(self.input_layernorm(x), masks, pos)
        return x + ffn(self.post_attention_layernorm(x))


class ScaledEmbedding(nn.Embedding):  # Gemma3TextScaledWordEmbedding
    def __init__(self, n, d, scale):
        super().__init__(n, d)
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class LlamaStyleModel(nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        H = c["hidden_size"]
        if kind == "gemma3_text":
            self.embed_tokens = ScaledEmbedding(c["vocab_size"], H, H ** 0.5)
        else:
            self.embed_tokens = nn.Embedding(c["vocab_size"], H)
        self.layers = nn.ModuleList([LlamaStyleLayer(c, i, kind) for i in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(H, c.get("rms_norm_eps", 1e-6), 1.0 if kind.startswith("gemma") else 0.0)
        self.kind = kind
        sw = c.get("sliding_window")
        if kind in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not c.get("use_sliding_window", False):
            sw = None
        self.sw = sw

    def forward(self, ids):
        h = self.embed_tokens(ids)
        if self.kind in ("gemma", "gemma2"):
            normalizer = torch.tensor(self.embed_tokens.weight.shape[1] ** 0.5, dtype=h.dtype)
            h = h * normalizer
        t = ids.shape[1]
        full = causal_mask(t)
        layer_sw = self.sw if self.kind in ("mistral", "mixtral") else None
        masks = {"full": causal_mask(t, sliding_window=layer_sw), "sliding": causal_mask(t, sliding_window=self.sw)}
        if layer_sw is None:
            masks["full"] = full
        pos = torch.arange(t)[None]
        for layer in self.layers:
            h = layer(h, masks, pos)
        return self.norm(h)


def causal_lm_loss(logits, targets, softcap=None):
    """From the LM head's logits to the loss as HF does it: the final logit softcap (Gemma 2/3
    *ForCausalLM.forward), then loss_utils.ForCausalLMLoss with targets pre-shifted: upcast
    (logits.float(), a copy only when the logits are not fp32) and F.cross_entropy."""
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    logits = logits.float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100)


class CausalLM(nn.Module):
    """*ForCausalLM wrapper: self.<base> + lm_head; loss as HF ForCausalLMLoss (targets pre-shifted)."""

    base_name = "model"

    def lm_logits(self, h):
        return self.lm_head(h)

    def forward(self, input_ids, targets):
        h = getattr(self, self.base_name)(input_ids)
        return causal_lm_loss(self.lm_logits(h), targets, getattr(self, "final_logit_softcapping", None))


class LlamaStyleForCausalLM(CausalLM):
    def __init__(self, c):
        super().__init__()
        kind = c["model_type"]
        self.model = LlamaStyleModel(c, kind)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = c.get("final_logit_softcapping") if kind in ("gemma2", "gemma3_text") else None


# =============================================================================
# DeepSeek V2 / V3 (MLA + MoE with shared experts)
# =============================================================================
class DeepseekAttention(nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        H, nh = c["hidden_size"], c["num_attention_heads"]
        self.nh, self.q_lora_rank = nh, c.get("q_lora_rank")
        self.rope_d, self.nope_d, self.v_d = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        self.kv_lora_rank = c["kv_lora_rank"]
        self.qk_d = self.rope_d + self.nope_d
        ab = bool(c.get("attention_bias", False))
        eps = c.get("rms_norm_eps", 1e-6)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(H, nh * self.qk_d, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, self.q_lora_rank, bias=ab)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # HF: default eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * self.qk_d, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora_rank + self.rope_d, bias=ab)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope_d + self.v_d), bias=False)
        self.o_proj = nn.Linear(nh * self.v_d, H, bias=ab)
        self.scaling = self.qk_d ** -0.5
        self.p_drop = c.get("attention_dropout", 0.0)
        if kind == "deepseek_v2":
            self.rope = Rope(self.rope_d, c.get("rope_theta", 10000.0), "pairs", cat_out=True)
        elif c.get("rope_interleave", True):
            self.rope = Rope(self.rope_d, c.get("rope_theta", 10000.0), "deint", cat_out=True)
        else:
            self.rope = Rope(self.rope_d, c.get("rope_theta", 10000.0), "half")

    def forward(self, x, masks, pos):
        b, t, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, -1, self.qk_d).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.nope_d, self.rope_d], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        k_pass, k_rot = torch.split(ckv, [self.kv_lora_rank, self.rope_d], dim=-1)
        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)).view(b, t, -1, self.nope_d + self.v_d).transpose(1, 2)
        k_pass, v = torch.split(k_pass, [self.nope_d, self.v_d], dim=-1)
        k_rot = k_rot.view(b, 1, t, self.rope_d)
        q_rot, k_rot = self.rope(q_rot, pos), self.rope(k_rot, pos)
        k_rot = k_rot.expand(*k_pass.shape[:-1], -1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot), dim=-1)
        o = eager_attention(q, k, v, masks["full"], self.scaling, self.p_drop, self.training)
        return self.o_proj(o.reshape(b, t, -1).contiguous())


class DeepseekV3TopkRouter(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.E, self.top_k = c["n_routed_experts"], c["num_experts_per_tok"]
        self.weight = nn.Parameter(torch.empty(self.E, c["hidden_size"]))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.E))

    @torch.no_grad()
    def get_topk_indices(self, scores):
        c = self.c
        sfc = scores.view(-1, self.E) + self.e_score_correction_bias.unsqueeze(0)
        gs = sfc.view(-1, c["n_group"], self.E // c["n_group"]).topk(2, dim=-1)[0].sum(dim=-1)
        gidx = torch.topk(gs, k=c["topk_group"], dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gs)
        gmask.scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(-1, c["n_group"], self.E // c["n_group"]).reshape(-1, self.E)
        sfc = sfc.masked_fill(~smask.bool(), 0.0)
        return torch.topk(sfc, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, x):
        x = x.view(-1, self.c["hidden_size"])
        logits = F.linear(x.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        idx = self.get_topk_indices(scores)
        w = scores.gather(1, idx)
        if self.c.get("norm_topk_prob", True):
            w /= w.sum(dim=-1, keepdim=True) + 1e-20
        w = w * self.c["routed_scaling_factor"]
        return idx, w


class DeepseekMoE(nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        H, mi = c["hidden_size"], c["moe_intermediate_size"]
        self.experts = nn.ModuleList([GatedMLP(H, mi, c["hidden_act"]) for _ in range(c["n_routed_experts"])])
        self.gate = DeepseekV3TopkRouter(c) if kind == "deepseek_v3" else nn.Linear(H, c["n_routed_experts"], bias=False)
        self.shared_experts = GatedMLP(H, mi * c["n_shared_experts"], c["hidden_act"])
        self.kind, self.c = kind, c

    def _v2_route(self, router_logits):
        c = self.c
        b, t, e = router_logits.shape
        rl = router_logits.view(-1, e).softmax(dim=-1, dtype=torch.float32)
        if c.get("topk_method", "greedy") == "greedy":
            w, idx = torch.topk(rl, k=c["num_experts_per_tok"], dim=-1, sorted=False)
        else:
            gs = rl.view(b * t, c["n_group"], -1).max(dim=-1).values
            gidx = torch.topk(gs, k=c["topk_group"], dim=-1, sorted=False)[1]
            gm = torch.zeros_like(gs)
            gm.scatter_(1, gidx, 1)
            sm = gm.unsqueeze(-1).expand(b * t, c["n_group"], e // c["n_group"]).reshape(b * t, -1)
            w, idx = torch.topk(rl.masked_fill(~sm.bool(), 0.0), k=c["num_experts_per_tok"], dim=-1, sorted=False)
        return idx, w * c["routed_scaling_factor"]

    def forward(self, x):
        residuals, shape = x, x.shape
        if self.kind == "deepseek_v3":
            idx, w = self.gate(x)
        else:
            idx, w = self._v2_route(F.linear(x.type(torch.float32), self.gate.weight.type(torch.float32)))
        x = x.view(-1, x.shape[-1])
        final = torch.zeros_like(x, dtype=w.dtype)
        expert_mask = F.one_hot(idx, num_classes=len(self.experts)).permute(2, 0, 1)
        _record_routing(self, expert_mask.sum(dim=(1, 2)).tolist())
        for e in range(len(self.experts)):
            tok, wi = torch.where(expert_mask[e])
            if tok.numel() > 0:
                ew = w[tok, wi]
                out = self.experts[e](x[tok])
                final.index_add_(0, tok, out * ew.unsqueeze(-1))
        x = final.type(x.dtype).view(*shape)
        return x + self.shared_experts(residuals)


class DeepseekLayer(nn.Module):
    def __init__(self, c, i, kind):
        super().__init__()
        H = c["hidden_size"]
        self.self_attn = DeepseekAttention(c, kind)
        self.mlp = DeepseekMoE(c, kind) if i >= c["first_k_dense_replace"] else GatedMLP(H, c["intermediate_size"], c["hidden_act"])
        self.input_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(H, c["rms_norm_eps"])

    def forward(self, x, masks, pos):
        x = x + self.self_attn(self.input_layernorm(x), masks, pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([DeepseekLayer(c, i, kind) for i in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, ids):
        h = self.embed_tokens(ids)
        masks = {"full": causal_mask(ids.shape[1])}
        pos = torch.arange(ids.shape[1])[None]
        for layer in self.layers:
            h = layer(h, masks, pos)
        return self.norm(h)


class DeepseekForCausalLM(CausalLM):
    def __init__(self, c):
        super().__init__()
        self.model = DeepseekModel(c, c["model_type"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight


# =============================================================================
# Registry and harness
# =============================================================================
FAMILIES = {}  # family -> list of (name, config, builder, block_regex)


def register(family, name, config, builder, block_regex):
    FAMILIES.setdefault(family, []).append((name, config, builder, block_regex))


def init_weights(model, seed):
    """Deterministic init: N(0, 0.02) for every parameter except norm weights (kept at 1, or 0 for
    (1+w) Gemma-style norms). Uses a private generator so results do not depend on call order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (RMSNorm, nn.LayerNorm)):
                if isinstance(m, nn.LayerNorm) and m.bias is not None:
                    m.bias.zero_()
                continue
            for p in m.parameters(recurse=False):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


class Recorder:
    def __init__(self, model):
        self.model = model
        self.stack = [""]
        self.entries = []  # (idx, tensor, module)
        self.handles = []
        for name, m in model.named_modules():
            m._hf_name = name
            if name == "":
                continue
            self.handles.append(m.register_forward_pre_hook(self._pre(name)))
            self.handles.append(m.register_forward_hook(self._post(name)))
        self.unpacked = []

    def _pre(self, name):
        def f(mod, inp):
            self.stack.append(name)
        return f

    def _post(self, name):
        def f(mod, inp, out):
            assert self.stack[-1] == name, (self.stack[-1], name)
            self.stack.pop()
        return f

    def pack(self, t):
        i = len(self.entries)
        self.entries.append((t, self.stack[-1]))
        return i

    def unpack(self, i):
        self.unpacked.append(i)
        return self.entries[i][0]

    def remove(self):
        for h in self.handles:
            h.remove()


def label_ops(rec, loss):
    """Walk the autograd graph; unpack every saved field to learn which node/attribute holds each packed tensor."""
    labels = {}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        name = n.name()
        attrs = [a for a in dir(n) if a.startswith("_saved_")]
        if hasattr(n, "saved_tensors") and not attrs:  # custom autograd.Function
            attrs = ["saved_tensors"]
        for a in attrs:
            rec.unpacked = []
            try:
                getattr(n, a)
            except Exception:
                continue
            for k, i in enumerate(rec.unpacked):
                tag = a[len("_saved_"):] if a.startswith("_saved_") else f"saved_tensors[{k}]"
                labels.setdefault(i, f"{name}.{tag}")
        for nxt, _ in n.next_functions:
            stack.append(nxt)
    rec.unpacked = []
    return labels


DT = {torch.float32: "f32", torch.float64: "f64", torch.int64: "i64", torch.bool: "bool", torch.int32: "i32", torch.float16: "f16", torch.bfloat16: "bf16", torch.uint8: "u8"}


def storage_key(t):
    s = t.storage()
    return (s.data_ptr(), s.nbytes()), s.nbytes()


def make_inputs(c, family):
    g = torch.Generator().manual_seed(1234)
    V = c["vocab_size"]
    if family == "bert":
        return bert_inputs(c, g)
    if family == "t5":
        ids = torch.randint(0, V, (B, T), generator=g)
        labels = torch.randint(0, V, (B, T5_DEC_T), generator=g)
        dec = torch.cat([torch.full((B, 1), c.get("decoder_start_token_id", 0)), labels[:, :-1]], dim=1)  # T5 _shift_right
        return {"input_ids": ids, "decoder_input_ids": dec, "labels": labels}, {"input_ids": ids, "decoder_input_ids": dec, "targets": labels}
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = F.pad(ids, (0, 1), value=-100)[..., 1:].contiguous()  # HF ForCausalLMLoss shift
    return {"input_ids": ids, "targets": targets}, {"input_ids": ids, "targets": targets}


def run_one(family, name, cfg, builder, block_regex):
    torch.manual_seed(0)
    ROUTING.clear()
    model = builder(cfg)
    init_weights(model, seed=42)
    model.train()
    params = []
    total = 0
    for pn, p in model.named_parameters():  # dedups tied weights, registration order
        params.append({"name": pn, "shape": list(p.shape), "numel": p.numel()})
        total += p.numel()
    ckpt_buffers = []
    for bn, b in model.named_buffers():
        if bn.endswith("e_score_correction_bias"):
            ckpt_buffers.append({"name": bn, "shape": list(b.shape), "numel": b.numel()})
    param_keys = {storage_key(p)[0] for p in model.parameters()}
    buffer_keys = {storage_key(b)[0] for b in model.buffers()}
    kwargs, inputs = make_inputs(cfg, family)
    input_keys = {storage_key(v)[0]: k for k, v in inputs.items()}

    rec = Recorder(model)
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
        loss = model(**kwargs)
    assert rec.stack == [""]
    labels = label_ops(rec, loss)
    loss.backward()  # sanity: the graph (incl. custom Functions) runs backward
    rec.remove()
    for pn, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no grad for {pn}"

    rx = re.compile(block_regex)
    saved, storage_ids = [], {}
    totals = {"act": 0, "input": 0, "buffer": 0, "scalar": 0}
    per_block, outside = {}, 0
    for i, (t, mod) in enumerate(rec.entries):
        key, nbytes = storage_key(t)
        if key in param_keys:
            continue
        kind = "input" if key in input_keys else "buffer" if key in buffer_keys else "act"
        if kind == "act" and t.dim() == 0 and t.dtype == torch.float64:
            kind = "scalar"  # Python number wrapped by e.g. `x * 0.125`; a CPU tensor even on GPU
        first = key not in storage_ids
        if first:
            storage_ids[key] = len(storage_ids)
        counted = nbytes if first else 0
        saved.append([mod, labels.get(i, "?"), list(t.shape), DT.get(t.dtype, str(t.dtype)), storage_ids[key], nbytes, counted, kind])
        totals[kind] += counted
        if kind == "act" and counted:
            m = rx.match(mod)
            if m:
                per_block[m.group(1)] = per_block.get(m.group(1), 0) + counted
            else:
                outside += counted
    out = {
        "family": family,
        "name": name,
        "config": cfg,
        "params": params,
        "total": total,
        "checkpoint_buffers": ckpt_buffers,
        "total_with_checkpoint_buffers": total + sum(b["numel"] for b in ckpt_buffers),
        "inputs": {k: {"shape": list(v.shape), "dtype": DT[v.dtype], "nbytes": v.numel() * v.element_size()} for k, v in inputs.items()},
        "loss": round(float(loss), 6),
        "saved_totals": {
            "total_bytes": totals["act"],
            "input_bytes": totals["input"],
            "buffer_bytes": totals["buffer"],
            "wrapped_scalar_bytes": totals["scalar"],
            "block_regex": block_regex,
            "per_block": [{"block": k, "index": int(re.findall(r"\d+", k)[-1]), "bytes": v} for k, v in per_block.items()],
            "outside_blocks": outside,
            "num_saved": len(saved),
            "num_storages": len(storage_ids),
        },
        "saved_columns": ["module", "op", "shape", "dtype", "storage_id", "storage_nbytes", "counted_bytes", "kind"],
        "saved": saved,
    }
    if ROUTING:
        out["routing"] = list(ROUTING)
    return out


# =============================================================================
# The loss path in fp32 and bf16: the LM head and causal_lm_loss alone
# =============================================================================
LOSS_PATH_RUNS = (("llama_gqa", torch.float32), ("llama_gqa", torch.bfloat16),
                  ("gemma2_softcap", torch.float32), ("gemma2_softcap", torch.bfloat16))
LOSS_PATH_ABOUT = (
    "The LM head (nn.Linear, no bias) and causal_lm_loss alone, on a leaf hidden state h (B,T,C) in the run's "
    "dtype (fp32 or bf16, CPU), with the head shape and final softcap of the named config: HF computes the "
    "logits in the model's precision and upcasts them for the loss. forward: the head's logits and what "
    "logits.float() returns (new_bytes 0: the same storage). saved: every tensor autograd keeps, as in "
    "configs[].saved (h and the targets are kind 'input'; the head's weight, a parameter, is not listed). "
    "grads: the gradient each autograd node on the way from the loss back to the head produces "
    "(Node.register_hook, grad_inputs[0]), new_bytes 0 where it is a view of another tensor (reshape).")


def run_loss_path(name, cfg, dtype):
    g = torch.Generator().manual_seed(4321)
    C, V = cfg["hidden_size"], cfg["vocab_size"]
    softcap = cfg.get("final_logit_softcapping") if cfg["model_type"] in ("gemma2", "gemma3_text") else None
    head = nn.Linear(C, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.02)
    head = head.to(dtype)
    h = torch.randn(B, T, C, generator=g).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = F.pad(ids, (0, 1), value=-100)[..., 1:].contiguous()
    entries = []

    def pack(t):
        entries.append(t)
        return len(entries) - 1

    class Rec:  # the part of a Recorder that label_ops uses
        def __init__(self):
            self.unpacked = []

    rec = Rec()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda i: rec.unpacked.append(i) or entries[i]):
        logits = head(h)
        loss = causal_lm_loss(logits, targets, softcap)
    labels = label_ops(rec, loss)
    # The logits' own storage and what .float() makes of them (re-run outside the hooks: same ops).
    with torch.no_grad():
        l32 = logits.float()
    forward = [["logits", list(logits.shape), DT[logits.dtype], logits.numel() * logits.element_size()],
               ["logits.float()", list(l32.shape), DT[l32.dtype],
                0 if l32.data_ptr() == logits.data_ptr() else l32.numel() * l32.element_size()]]
    param_keys = {storage_key(p)[0] for p in head.parameters()}
    input_keys = {storage_key(h)[0], storage_key(targets)[0]}
    saved, storage_ids = [], {}
    for i, t in enumerate(entries):
        key, nbytes = storage_key(t)
        if key in param_keys:
            continue
        kind = "input" if key in input_keys else "act"
        if kind == "act" and t.dim() == 0 and t.dtype == torch.float64:
            kind = "scalar"
        first = key not in storage_ids
        if first:
            storage_ids[key] = len(storage_ids)
        saved.append([labels.get(i, "?"), list(t.shape), DT.get(t.dtype, str(t.dtype)), storage_ids[key], nbytes,
                      nbytes if first else 0, kind])
    # The nodes from the loss back to the head's matmul (first inputs), hooked in that order.
    grads, chain, n = [], [], loss.grad_fn
    while n is not None and n.name() not in ("MmBackward0", "AddmmBackward0"):
        chain.append(n)
        n = n.next_functions[0][0]
    for node in chain:
        def hook(gi, go, node=node):
            d = gi[0]
            grads.append([node.name(), list(d.shape), DT[d.dtype], 0 if d._base is not None else storage_key(d)[1]])
        node.register_hook(hook)
    loss.backward()
    return {"config": name, "dtype": DT[dtype], "B": B, "T": T, "C": C, "V": V, "softcap": softcap,
            "forward": forward, "saved_columns": ["op", "shape", "dtype", "storage_id", "storage_nbytes",
                                                  "counted_bytes", "kind"],
            "saved": saved, "grads_columns": ["node", "shape", "dtype", "new_bytes"], "grads": grads}


def dump_fixture(path, payload):
    """JSON with one saved-tensor row / param per line (readable, compact)."""
    def enc(o):
        return json.dumps(o, separators=(",", ":"))

    lines = ["{"]
    lines.append(f' "description": {enc(payload["description"])},')
    lines.append(f' "generator": {enc(payload["generator"])},')
    lines.append(f' "conventions": {json.dumps(payload["conventions"], indent=2)},')
    lines.append(' "configs": [')
    for ci, c in enumerate(payload["configs"]):
        lines.append("  {")
        keys = list(c.keys())
        for ki, k in enumerate(keys):
            comma = "," if ki + 1 < len(keys) else ""
            v = c[k]
            if k in ("params", "saved") and v:
                lines.append(f'   "{k}": [')
                for ri, row in enumerate(v):
                    lines.append("    " + enc(row) + ("," if ri + 1 < len(v) else ""))
                lines.append("   ]" + comma)
            else:
                lines.append(f'   "{k}": {enc(v)}{comma}')
        lines.append("  }" + ("," if ci + 1 < len(payload["configs"]) else ""))
    lines.append(" ]" + ("," if "loss_path" in payload else ""))
    if "loss_path" in payload:
        lp = payload["loss_path"]
        lines.append(' "loss_path": {')
        lines.append(f'  "about": {enc(lp["about"])},')
        lines.append('  "runs": [')
        for ri, r in enumerate(lp["runs"]):
            lines.append("   " + enc(r) + ("," if ri + 1 < len(lp["runs"]) else ""))
        lines.append("  ]")
        lines.append(" }")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    json.loads(text)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return len(text)


# =============================================================================
# Configurations (HF config.json field names)
# =============================================================================
LLAMA_RX = r"^(model\.layers\.\d+)(\.|$)"


def _llama_like():
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, hidden_act="silu", max_position_embeddings=128, rms_norm_eps=1e-6,
                rope_theta=10000.0, attention_dropout=0.0, tie_word_embeddings=False, initializer_range=0.02)
    register("llama", "llama_gqa", dict(base, model_type="llama", head_dim=8, attention_bias=False, mlp_bias=False,
                                        pretraining_tp=1, rope_scaling=None), LlamaStyleForCausalLM, LLAMA_RX)
    register("mistral", "mistral_swa", dict(base, model_type="mistral", head_dim=8, sliding_window=8),
             LlamaStyleForCausalLM, LLAMA_RX)
    register("mixtral", "mixtral_moe", dict(base, model_type="mixtral", head_dim=8, intermediate_size=96, sliding_window=None,
                                            num_local_experts=4, num_experts_per_tok=2, output_router_logits=False,
                                            router_aux_loss_coef=0.02, router_jitter_noise=0.0),
             LlamaStyleForCausalLM, LLAMA_RX)
    register("qwen2", "qwen2_bias", dict(base, model_type="qwen2", num_key_value_heads=4, use_sliding_window=False,
                                         sliding_window=None, max_window_layers=2), LlamaStyleForCausalLM, LLAMA_RX)
    register("qwen2_moe", "qwen2_moe_shared", dict(base, model_type="qwen2_moe", num_key_value_heads=4,
                                                   qkv_bias=True, use_sliding_window=False, sliding_window=None, max_window_layers=2,
                                                   decoder_sparse_step=1, mlp_only_layers=[1], moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=96, num_experts_per_tok=2, num_experts=4,
                                                   norm_topk_prob=False, output_router_logits=False, router_aux_loss_coef=0.001),
             LlamaStyleForCausalLM, LLAMA_RX)
    register("qwen3", "qwen3_qknorm_tied", dict(base, model_type="qwen3", head_dim=16, attention_bias=False, tie_word_embeddings=True,
                                                use_sliding_window=False, sliding_window=None, max_window_layers=2,
                                                layer_types=["full_attention", "full_attention"]), LlamaStyleForCausalLM, LLAMA_RX)
    register("qwen3_moe", "qwen3_moe_step2", dict(base, model_type="qwen3_moe", head_dim=16, attention_bias=False,
                                                  use_sliding_window=False, sliding_window=None, max_window_layers=2,
                                                  decoder_sparse_step=2, mlp_only_layers=[], moe_intermediate_size=32,
                                                  num_experts_per_tok=2, num_experts=4, norm_topk_prob=True,
                                                  output_router_logits=False, router_aux_loss_coef=0.001),
             LlamaStyleForCausalLM, LLAMA_RX)
    gem = dict(base, num_attention_heads=4, num_key_value_heads=1, head_dim=32, hidden_act="gelu_pytorch_tanh",
               hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, attention_bias=False, pad_token_id=0)
    register("gemma", "gemma_mqa_tied", dict(gem, model_type="gemma"), LlamaStyleForCausalLM, LLAMA_RX)
    register("gemma2", "gemma2_softcap", dict(gem, model_type="gemma2", num_key_value_heads=2, query_pre_attn_scalar=32,
                                              sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                              layer_types=["sliding_attention", "full_attention"]),
             LlamaStyleForCausalLM, LLAMA_RX)
    register("gemma3_text", "gemma3_text_pattern", dict(gem, model_type="gemma3_text", num_key_value_heads=2,
                                                        query_pre_attn_scalar=32, sliding_window=8, rope_theta=1000000.0,
                                                        rope_local_base_freq=10000.0, final_logit_softcapping=None,
                                                        attn_logit_softcapping=None, rope_scaling=None,
                                                        layer_types=["sliding_attention", "full_attention"]),
             LlamaStyleForCausalLM, LLAMA_RX)
    register("olmo2", "olmo2_postnorm", dict(base, model_type="olmo2", num_key_value_heads=4, attention_bias=False, pad_token_id=1),
             LlamaStyleForCausalLM, LLAMA_RX)
    register("gpt_oss", "gpt_oss_sinks", dict(base, model_type="gpt_oss", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                              sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                              attention_bias=True, rms_norm_eps=1e-5, rope_scaling=None, swiglu_limit=7.0,
                                              output_router_logits=False, router_aux_loss_coef=0.9),
             LlamaStyleForCausalLM, LLAMA_RX)
    ds = dict(base, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=1.0,
              kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
              attention_bias=False, mlp_bias=False, rope_scaling=None)
    register("deepseek_v2", "deepseek_v2_lite", dict(ds, model_type="deepseek_v2", q_lora_rank=None, topk_method="greedy",
                                                     n_group=1, topk_group=1, norm_topk_prob=False, moe_layer_freq=1),
             DeepseekForCausalLM, LLAMA_RX)
    register("deepseek_v3", "deepseek_v3_qlora", dict(ds, model_type="deepseek_v3", q_lora_rank=24, n_group=2, topk_group=1,
                                                      norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True),
             DeepseekForCausalLM, LLAMA_RX)


def build_registry():
    FAMILIES.clear()
    _llama_like()
    for fn in EXTRA_REGISTRATIONS:
        fn()


EXTRA_REGISTRATIONS = []


# =============================================================================
# GPT-2 (Conv1D, learned positions, tied head)
# =============================================================================
class GPT2Attention(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        H, mp = c["n_embd"], c["n_positions"]
        self.register_buffer("bias", torch.tril(torch.ones((mp, mp), dtype=torch.bool)).view(1, 1, mp, mp), persistent=False)
        self.register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)
        self.nh, self.hd, self.H = c["n_head"], H // c["n_head"], H
        self.scale_attn_weights = c.get("scale_attn_weights", True)
        self.c_attn = Conv1D(3 * H, H)
        self.c_proj = Conv1D(H, H)
        self.p_attn, self.p_resid = c["attn_pdrop"], c["resid_pdrop"]

    def _split(self, x):
        return x.view(x.size()[:-1] + (self.nh, self.hd)).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.H, dim=2)
        q, k, v = self._split(q), self._split(k), self._split(v)
        w = torch.matmul(q, k.transpose(-1, -2))
        if self.scale_attn_weights:
            w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype)
        ql, kl = q.size(-2), k.size(-2)
        cm = self.bias[:, :, kl - ql: kl, :kl]
        w = torch.where(cm, w.to(w.dtype), torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype))
        w = F.softmax(w, dim=-1).type(v.dtype)
        w = dropout(w, self.p_attn, self.training)
        o = torch.matmul(w, v)
        o = o.permute(0, 2, 1, 3).contiguous()
        o = o.view(o.size()[:-2] + (self.H,))
        return dropout(self.c_proj(o), self.p_resid, self.training)


class GPT2MLP(nn.Module):
    def __init__(self, inner, c):
        super().__init__()
        self.c_fc = Conv1D(inner, c["n_embd"])
        self.c_proj = Conv1D(c["n_embd"], inner)
        self.act = ACT[c["activation_function"]]
        self.p = c["resid_pdrop"]

    def forward(self, x):
        return dropout(self.c_proj(self.act(self.c_fc(x))), self.p, self.training)


class GPT2Block(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        H = c["n_embd"]
        self.ln_1 = nn.LayerNorm(H, eps=c["layer_norm_epsilon"])
        self.attn = GPT2Attention(c, i)
        self.ln_2 = nn.LayerNorm(H, eps=c["layer_norm_epsilon"])
        self.mlp = GPT2MLP(c.get("n_inner") or 4 * H, c)

    def forward(self, x):
        x = self.attn(self.ln_1(x)) + x
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["n_positions"], c["n_embd"])
        self.p = c["embd_pdrop"]
        self.h = nn.ModuleList([GPT2Block(c, i) for i in range(c["n_layer"])])
        self.ln_f = nn.LayerNorm(c["n_embd"], eps=c["layer_norm_epsilon"])

    def forward(self, ids):
        pos = torch.arange(0, ids.shape[1], dtype=torch.long).unsqueeze(0)
        h = dropout(self.wte(ids) + self.wpe(pos), self.p, self.training)
        for blk in self.h:
            h = blk(h)
        return self.ln_f(h)


class GPT2LMHeadModel(CausalLM):
    base_name = "transformer"

    def __init__(self, c):
        super().__init__()
        self.transformer = GPT2Model(c)
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied


# =============================================================================
# Phi (parallel attn+MLP on one LayerNorm, partial rotary, biases) and Phi-3
# =============================================================================
class PhiAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh = c["hidden_size"], c["num_attention_heads"]
        nkv = c.get("num_key_value_heads") or nh
        self.hd = H // nh
        self.q_proj = nn.Linear(H, nh * self.hd, bias=True)
        self.k_proj = nn.Linear(H, nkv * self.hd, bias=True)
        self.v_proj = nn.Linear(H, nkv * self.hd, bias=True)
        self.dense = nn.Linear(nh * self.hd, H, bias=True)
        self.rope = Rope(int(self.hd * c["partial_rotary_factor"]), c.get("rope_theta", 10000.0), "half", cat_out=True)
        self.p = c.get("attention_dropout", 0.0)

    def forward(self, x, mask, pos):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        q, k = self.rope(q, pos), self.rope(k, pos)
        o = eager_attention(q, k, v, mask, self.hd ** -0.5, self.p, self.training)
        return self.dense(o.reshape(b, t, -1).contiguous())


class PhiMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc1 = nn.Linear(c["hidden_size"], c["intermediate_size"])
        self.fc2 = nn.Linear(c["intermediate_size"], c["hidden_size"])
        self.act = ACT[c["hidden_act"]]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class PhiDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = PhiAttention(c)
        self.mlp = PhiMLP(c)
        self.input_layernorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.p = c["resid_pdrop"]

    def forward(self, x, mask, pos):
        h = self.input_layernorm(x)
        a = dropout(self.self_attn(h, mask, pos), self.p, self.training)
        f = dropout(self.mlp(h), self.p, self.training)
        return a + f + x


class PhiModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.p = c["embd_pdrop"]
        self.layers = nn.ModuleList([PhiDecoderLayer(c) for _ in range(c["num_hidden_layers"])])
        self.final_layernorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])

    def forward(self, ids):
        h = dropout(self.embed_tokens(ids), self.p, self.training)
        mask, pos = causal_mask(ids.shape[1]), torch.arange(ids.shape[1])[None]
        for layer in self.layers:
            h = layer(h, mask, pos)
        return self.final_layernorm(h)


class PhiForCausalLM(CausalLM):
    def __init__(self, c):
        super().__init__()
        self.model = PhiModel(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=True)


class Phi3Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh = c["hidden_size"], c["num_attention_heads"]
        nkv = c.get("num_key_value_heads") or nh
        self.hd = c.get("head_dim") or H // nh
        self.nh, self.nkv = nh, nkv
        self.o_proj = nn.Linear(nh * self.hd, H, bias=False)
        self.qkv_proj = nn.Linear(H, nh * self.hd + 2 * nkv * self.hd, bias=False)
        rd = int(self.hd * c.get("partial_rotary_factor", 1.0))
        self.rope = Rope(rd, c.get("rope_theta", 10000.0), "half")
        self.p = c.get("attention_dropout", 0.0)

    def forward(self, x, mask, pos):
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        qp, kp = self.nh * self.hd, self.nkv * self.hd
        q, k, v = qkv[..., :qp], qkv[..., qp: qp + kp], qkv[..., qp + kp:]
        q = q.view(b, t, -1, self.hd).transpose(1, 2)
        k = k.view(b, t, -1, self.hd).transpose(1, 2)
        v = v.view(b, t, -1, self.hd).transpose(1, 2)
        q, k = self.rope(q, pos), self.rope(k, pos)
        o = eager_attention(q, k, v, mask, self.hd ** -0.5, self.p, self.training)
        return self.o_proj(o.reshape(b, t, -1).contiguous())


class Phi3MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_up_proj = nn.Linear(c["hidden_size"], 2 * c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)
        self.act = ACT[c["hidden_act"]]

    def forward(self, x):
        up = self.gate_up_proj(x)
        gate, up = up.chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))


class Phi3DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Phi3Attention(c)
        self.mlp = Phi3MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.p = c["resid_pdrop"]

    def forward(self, x, mask, pos):
        x = x + dropout(self.self_attn(self.input_layernorm(x), mask, pos), self.p, self.training)
        return x + dropout(self.mlp(self.post_attention_layernorm(x)), self.p, self.training)


class Phi3Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.p = c["embd_pdrop"]
        self.layers = nn.ModuleList([Phi3DecoderLayer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.sw = c.get("sliding_window")

    def forward(self, ids):
        h = dropout(self.embed_tokens(ids), self.p, self.training)
        mask, pos = causal_mask(ids.shape[1], sliding_window=self.sw), torch.arange(ids.shape[1])[None]
        for layer in self.layers:
            h = layer(h, mask, pos)
        return self.norm(h)


class Phi3ForCausalLM(CausalLM):
    def __init__(self, c):
        super().__init__()
        self.model = Phi3Model(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight


# =============================================================================
# GPT-NeoX
# =============================================================================
class GPTNeoXAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh = c["hidden_size"], c["num_attention_heads"]
        self.hd = H // nh
        ab = c.get("attention_bias", True)
        self.query_key_value = nn.Linear(H, 3 * H, bias=ab)
        self.dense = nn.Linear(H, H, bias=ab)
        self.rope = Rope(int(self.hd * c["rotary_pct"]), c.get("rotary_emb_base", 10000), "half", cat_out=True)
        self.p = c.get("attention_dropout", 0.0)

    def forward(self, x, mask, pos):
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, -1, 3 * self.hd).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        q, k = self.rope(q, pos), self.rope(k, pos)
        o = eager_attention(q, k, v, mask, self.hd ** -0.5, self.p, self.training)
        return self.dense(o.reshape(b, t, -1).contiguous())


class GPTNeoXMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(c["hidden_size"], c["intermediate_size"])
        self.dense_4h_to_h = nn.Linear(c["intermediate_size"], c["hidden_size"])
        self.act = ACT[c["hidden_act"]]

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.use_parallel_residual = c["use_parallel_residual"]
        self.input_layernorm = nn.LayerNorm(H, eps=c["layer_norm_eps"])
        self.post_attention_layernorm = nn.LayerNorm(H, eps=c["layer_norm_eps"])
        self.p = c["hidden_dropout"]
        self.attention = GPTNeoXAttention(c)
        self.mlp = GPTNeoXMLP(c)

    def forward(self, x, mask, pos):
        a = dropout(self.attention(self.input_layernorm(x), mask, pos), self.p, self.training)
        if self.use_parallel_residual:
            m = dropout(self.mlp(self.post_attention_layernorm(x)), self.p, self.training)
            return m + a + x
        a = a + x
        return dropout(self.mlp(self.post_attention_layernorm(a)), self.p, self.training) + a


class GPTNeoXModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_in = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.p = c["hidden_dropout"]
        self.layers = nn.ModuleList([GPTNeoXLayer(c) for _ in range(c["num_hidden_layers"])])
        self.final_layer_norm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])

    def forward(self, ids):
        h = dropout(self.embed_in(ids), self.p, self.training)
        mask, pos = causal_mask(ids.shape[1]), torch.arange(ids.shape[1])[None]
        for layer in self.layers:
            h = layer(h, mask, pos)
        return self.final_layer_norm(h)


class GPTNeoXForCausalLM(CausalLM):
    base_name = "gpt_neox"

    def __init__(self, c):
        super().__init__()
        self.gpt_neox = GPTNeoXModel(c)
        self.embed_out = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def lm_logits(self, h):
        return self.embed_out(h)


# =============================================================================
# OPT
# =============================================================================
class OPTAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh = c["hidden_size"], c["num_attention_heads"]
        self.hd, self.scaling = H // nh, (H // nh) ** -0.5
        bias = c.get("enable_bias", True)
        self.k_proj = nn.Linear(H, H, bias=bias)
        self.v_proj = nn.Linear(H, H, bias=bias)
        self.q_proj = nn.Linear(H, H, bias=bias)
        self.out_proj = nn.Linear(H, H, bias=bias)
        self.p = c["attention_dropout"]

    def forward(self, x, mask):
        b, t, _ = x.shape
        q = self.q_proj(x) * self.scaling
        q = q.view(b, t, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = eager_attention(q, k, v, mask, 1.0, self.p, self.training)
        return self.out_proj(o.reshape(b, t, -1).contiguous())


class OPTDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        bias, aff = c.get("enable_bias", True), c.get("layer_norm_elementwise_affine", True)
        self.self_attn = OPTAttention(c)
        self.do_layer_norm_before = c["do_layer_norm_before"]
        self.p = c["dropout"]
        self.act = ACT[c["activation_function"]]
        self.self_attn_layer_norm = nn.LayerNorm(H, elementwise_affine=aff)
        self.fc1 = nn.Linear(H, c["ffn_dim"], bias=bias)
        self.fc2 = nn.Linear(c["ffn_dim"], H, bias=bias)
        self.final_layer_norm = nn.LayerNorm(H, elementwise_affine=aff)

    def forward(self, x, mask):
        r = x
        if self.do_layer_norm_before:
            x = self.self_attn_layer_norm(x)
        x = r + dropout(self.self_attn(x, mask), self.p, self.training)
        if not self.do_layer_norm_before:
            x = self.self_attn_layer_norm(x)
        shape = x.shape
        x = x.reshape(-1, x.size(-1))
        r = x
        if self.do_layer_norm_before:
            x = self.final_layer_norm(x)
        x = dropout(self.fc2(self.act(self.fc1(x))), self.p, self.training)
        x = (r + x).view(shape)
        if not self.do_layer_norm_before:
            x = self.final_layer_norm(x)
        return x


class OPTLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, n, d):
        self.offset = 2
        super().__init__(n + self.offset, d)

    def forward(self, attention_mask):
        pos = torch.cumsum(attention_mask, dim=1)
        pos = (pos * attention_mask - 1).long()
        return super().forward(pos + self.offset)


class OPTDecoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, W = c["hidden_size"], c["word_embed_proj_dim"]
        self.embed_tokens = nn.Embedding(c["vocab_size"], W)
        self.embed_positions = OPTLearnedPositionalEmbedding(c["max_position_embeddings"], H)
        self.project_out = nn.Linear(H, W, bias=False) if W != H else None
        self.project_in = nn.Linear(W, H, bias=False) if W != H else None
        if c["do_layer_norm_before"] and not c.get("_remove_final_layer_norm", False):
            self.final_layer_norm = nn.LayerNorm(H, elementwise_affine=c.get("layer_norm_elementwise_affine", True))
        else:
            self.final_layer_norm = None
        self.layers = nn.ModuleList([OPTDecoderLayer(c) for _ in range(c["num_hidden_layers"])])

    def forward(self, ids):
        am = torch.ones(ids.shape, dtype=torch.long)
        e = self.embed_tokens(ids)
        pe = self.embed_positions(am)
        if self.project_in is not None:
            e = self.project_in(e)
        h = e + pe
        mask = causal_mask(ids.shape[1])
        for layer in self.layers:
            h = layer(h, mask)
        if self.final_layer_norm is not None:
            h = self.final_layer_norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return h


class OPTModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.decoder = OPTDecoder(c)

    def forward(self, ids):
        return self.decoder(ids)


class OPTForCausalLM(CausalLM):
    def __init__(self, c):
        super().__init__()
        self.model = OPTModel(c)
        self.lm_head = nn.Linear(c["word_embed_proj_dim"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", True):
            self.lm_head.weight = self.model.decoder.embed_tokens.weight


# =============================================================================
# Falcon
# =============================================================================
class FalconLinear(nn.Linear):
    def forward(self, x):
        h = x @ self.weight.T
        return h if self.bias is None else h + self.bias


class FalconAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh = c["hidden_size"], c["num_attention_heads"]
        self.nh, self.hd = nh, H // nh
        self.new_arch, self.multi_query = c["new_decoder_architecture"], c["multi_query"]
        if self.new_arch:
            qkv_out = (c["num_kv_heads"] * 2 + nh) * self.hd
        elif self.multi_query:
            qkv_out = H + 2 * self.hd
        else:
            qkv_out = 3 * H
        self.num_kv_heads = c["num_kv_heads"] if (self.new_arch or not self.multi_query) else 1
        self.query_key_value = FalconLinear(H, qkv_out, bias=c["bias"])
        self.dense = FalconLinear(H, H, bias=c["bias"])
        self.rope = Rope(self.hd, c.get("rope_theta", 10000.0), "half")

    def _split_heads(self, f):
        b, t, _ = f.shape
        if self.new_arch:
            qkv = f.view(b, t, -1, self.nh // self.num_kv_heads + 2, self.hd)
            q = qkv[:, :, :, :-2]
            k = torch.broadcast_to(qkv[:, :, :, [-2]], q.shape)
            v = torch.broadcast_to(qkv[:, :, :, [-1]], q.shape)
            return [x.flatten(2, 3) for x in (q, k, v)]
        if not self.multi_query:
            f = f.view(b, t, self.nh, 3, self.hd)
            return f[..., 0, :], f[..., 1, :], f[..., 2, :]
        f = f.view(b, t, self.nh + 2, self.hd)
        return f[..., :-2, :], f[..., [-2], :], f[..., [-1], :]

    def forward(self, x, mask, pos):
        b, t, _ = x.shape
        fused = self.query_key_value(x)
        nkv = self.nh if self.new_arch else self.num_kv_heads
        q, k, v = self._split_heads(fused)
        q = q.transpose(1, 2).reshape(b, self.nh, t, self.hd)
        k = k.transpose(1, 2).reshape(b, nkv, t, self.hd)
        v = v.transpose(1, 2).reshape(b, nkv, t, self.hd)
        q, k = self.rope(q, pos), self.rope(k, pos)
        s = q @ k.transpose(-1, -2)
        s /= math.sqrt(self.hd)
        s = F.softmax(s + mask, dim=-1, dtype=x.dtype)
        o = s @ v
        o = o.view(b, self.nh, t, self.hd).permute(0, 2, 1, 3).reshape(b, t, self.nh * self.hd)
        return self.dense(o)


class FalconMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        ffn = c.get("ffn_hidden_size") or 4 * H
        self.dense_h_to_4h = FalconLinear(H, ffn, bias=c["bias"])
        self.act = ACT[c.get("activation", "gelu")]
        self.dense_4h_to_h = FalconLinear(ffn, H, bias=c["bias"])

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, eps = c["hidden_size"], c["layer_norm_epsilon"]
        self.c = c
        self.self_attention = FalconAttention(c)
        self.mlp = FalconMLP(c)
        self.n_ln = c.get("num_ln_in_parallel_attn")
        if self.n_ln is None and c["new_decoder_architecture"]:
            self.n_ln = 2
        if not c["parallel_attn"]:
            self.post_attention_layernorm = nn.LayerNorm(H, eps=eps)
            self.input_layernorm = nn.LayerNorm(H, eps=eps)
        elif self.n_ln == 2:
            self.ln_attn = nn.LayerNorm(H, eps=eps)
            self.ln_mlp = nn.LayerNorm(H, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(H, eps=eps)

    def forward(self, x, mask, pos):
        c = self.c
        residual = x
        if c["new_decoder_architecture"] and self.n_ln == 2:
            attn_ln, mlp_ln = self.ln_attn(x), self.ln_mlp(x)
        else:
            attn_ln = self.input_layernorm(x)
        a = self.self_attention(attn_ln, mask, pos)
        if not c["new_decoder_architecture"]:
            if c["parallel_attn"]:
                mlp_ln = attn_ln
            else:
                residual = residual + dropout(a, c["attention_dropout"], self.training)
                mlp_ln = self.post_attention_layernorm(residual)
        if c["new_decoder_architecture"] and c["parallel_attn"] and self.n_ln == 1:
            mlp_ln = attn_ln
        m = self.mlp(mlp_ln)
        if c["new_decoder_architecture"] or c["parallel_attn"]:
            m += a
        return residual + dropout(m, c["hidden_dropout"], self.training)


class FalconModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.h = nn.ModuleList([FalconDecoderLayer(c) for _ in range(c["num_hidden_layers"])])
        self.ln_f = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_epsilon"])

    def forward(self, ids):
        h = self.word_embeddings(ids)
        mask, pos = causal_mask(ids.shape[1]), torch.arange(ids.shape[1])[None]
        for layer in self.h:
            h = layer(h, mask, pos)
        return self.ln_f(h)


class FalconForCausalLM(CausalLM):
    base_name = "transformer"

    def __init__(self, c):
        super().__init__()
        self.transformer = FalconModel(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", True):
            self.lm_head.weight = self.transformer.word_embeddings.weight


# =============================================================================
# BLOOM (alibi)
# =============================================================================
def build_alibi_tensor(attention_mask, num_heads, dtype):
    b, t = attention_mask.shape
    cp2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(cp2) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + cp2, dtype=torch.int32))
    if cp2 != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * cp2) - 3))), dtype=torch.float32)
        n_rem = min(cp2, num_heads - cp2)
        slopes = torch.cat([slopes, torch.pow(extra_base, torch.arange(1, 1 + 2 * n_rem, 2, dtype=torch.int32))], dim=0)
    ar = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * ar
    return alibi.reshape(b * num_heads, 1, t).to(dtype)


class BloomAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh = c["hidden_size"], c["n_head"]
        self.nh, self.hd = nh, H // nh
        self.inv_norm_factor, self.beta = 1.0 / math.sqrt(self.hd), 1.0
        self.query_key_value = nn.Linear(H, 3 * H, bias=True)
        self.dense = nn.Linear(H, H)
        self.p_attn, self.p_hidden = c["attention_dropout"], c["hidden_dropout"]

    def forward(self, x, residual, alibi, mask):
        b, t, _ = x.shape
        f = self.query_key_value(x).view(b, t, self.nh, 3, self.hd)
        q, k, v = f[..., 0, :], f[..., 1, :], f[..., 2, :]
        q = q.transpose(1, 2).reshape(b * self.nh, t, self.hd)
        k = k.permute(0, 2, 3, 1).reshape(b * self.nh, self.hd, t)
        v = v.transpose(1, 2).reshape(b * self.nh, t, self.hd)
        s = alibi.baddbmm(batch1=q, batch2=k, beta=self.beta, alpha=self.inv_norm_factor)
        s = s.view(b, self.nh, t, -1)
        w = s + mask[:, :, :, : k.shape[-1]]
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(s.dtype)
        p = dropout(p, self.p_attn, self.training)
        ctx = torch.bmm(p.view(b * self.nh, t, -1), v)
        ctx = ctx.view(b, self.nh, t, self.hd).permute(0, 2, 1, 3).reshape(b, t, self.nh * self.hd)
        return residual + dropout(self.dense(ctx), self.p_hidden, self.training)


class BloomGelu(nn.Module):
    def forward(self, x):
        return BloomGeLUFunction.apply(x) if self.training else x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.dense_h_to_4h = nn.Linear(H, 4 * H)
        self.gelu_impl = BloomGelu()
        self.dense_4h_to_h = nn.Linear(4 * H, H)
        self.p = c["hidden_dropout"]

    def forward(self, x, residual):
        return residual + dropout(self.dense_4h_to_h(self.gelu_impl(self.dense_h_to_4h(x))), self.p, self.training)


class BloomBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, eps = c["hidden_size"], c["layer_norm_epsilon"]
        self.input_layernorm = nn.LayerNorm(H, eps=eps)
        self.self_attention = BloomAttention(c)
        self.post_attention_layernorm = nn.LayerNorm(H, eps=eps)
        self.mlp = BloomMLP(c)
        self.post_ln_residual = c.get("apply_residual_connection_post_layernorm", False)

    def forward(self, x, alibi, mask):
        ln = self.input_layernorm(x)
        a = self.self_attention(ln, ln if self.post_ln_residual else x, alibi, mask)
        ln = self.post_attention_layernorm(a)
        return self.mlp(ln, ln if self.post_ln_residual else a)


class BloomModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.nh = c["n_head"]
        self.word_embeddings = nn.Embedding(c["vocab_size"], H)
        self.word_embeddings_layernorm = nn.LayerNorm(H, eps=c["layer_norm_epsilon"])
        self.h = nn.ModuleList([BloomBlock(c) for _ in range(c["n_layer"])])
        self.ln_f = nn.LayerNorm(H, eps=c["layer_norm_epsilon"])

    def forward(self, ids):
        h = self.word_embeddings_layernorm(self.word_embeddings(ids))
        alibi = build_alibi_tensor(torch.ones(ids.shape, dtype=torch.long), self.nh, h.dtype)
        mask = causal_mask(ids.shape[1])
        for blk in self.h:
            h = blk(h, alibi, mask)
        return self.ln_f(h)


class BloomForCausalLM(CausalLM):
    base_name = "transformer"

    def __init__(self, c):
        super().__init__()
        self.transformer = BloomModel(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.word_embeddings.weight


# =============================================================================
# T5 (encoder-decoder)
# =============================================================================
def t5_relative_position_bucket(rp, bidirectional=True, num_buckets=32, max_distance=128):
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets += (rp > 0).to(torch.long) * num_buckets
        rp = torch.abs(rp)
    else:
        rp = -torch.min(rp, torch.zeros_like(rp))
    max_exact = num_buckets // 2
    is_small = rp < max_exact
    large = max_exact + (torch.log(rp.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, rp, large)


class T5Attention(nn.Module):
    def __init__(self, c, is_decoder, has_relative_attention_bias):
        super().__init__()
        self.is_decoder, self.has_rab = is_decoder, has_relative_attention_bias
        self.nb, self.md = c["relative_attention_num_buckets"], c["relative_attention_max_distance"]
        self.d_model, self.d_kv, self.nh = c["d_model"], c["d_kv"], c["num_heads"]
        inner = self.nh * self.d_kv
        self.q = nn.Linear(self.d_model, inner, bias=False)
        self.k = nn.Linear(self.d_model, inner, bias=False)
        self.v = nn.Linear(self.d_model, inner, bias=False)
        self.o = nn.Linear(inner, self.d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.nb, self.nh)
        self.p = c["dropout_rate"]

    def compute_bias(self, ql, kl):
        ctxp = torch.arange(ql, dtype=torch.long)[:, None]
        memp = torch.arange(kl, dtype=torch.long)[None, :]
        bucket = t5_relative_position_bucket(memp - ctxp, bidirectional=not self.is_decoder, num_buckets=self.nb, max_distance=self.md)
        return self.relative_attention_bias(bucket).permute([2, 0, 1]).unsqueeze(0)

    def forward(self, x, mask, kv=None, position_bias=None):
        b, t, _ = x.shape
        src = x if kv is None else kv
        q = self.q(x).view(b, -1, self.nh, self.d_kv).transpose(1, 2)
        k = self.k(src).view(b, -1, self.nh, self.d_kv).transpose(1, 2)
        v = self.v(src).view(b, -1, self.nh, self.d_kv).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(3, 2))
        if position_bias is None:
            kl = k.shape[-2]
            if not self.has_rab:
                position_bias = torch.zeros((1, self.nh, t, kl), dtype=scores.dtype)
            else:
                position_bias = self.compute_bias(t, kl)
            position_bias = position_bias + mask[:, :, :, :kl]
        scores += position_bias
        w = F.softmax(scores.float(), dim=-1).type_as(scores)
        w = dropout(w, self.p, self.training)
        o = torch.matmul(w, v).transpose(1, 2).contiguous().view(b, -1, self.nh * self.d_kv)
        return self.o(o), position_bias


class T5LayerSelfAttention(nn.Module):
    def __init__(self, c, is_decoder, has_rab):
        super().__init__()
        self.SelfAttention = T5Attention(c, is_decoder, has_rab)
        self.layer_norm = RMSNorm(c["d_model"], c["layer_norm_epsilon"])
        self.p = c["dropout_rate"]

    def forward(self, x, mask, position_bias):
        a, pb = self.SelfAttention(self.layer_norm(x), mask, position_bias=position_bias)
        return x + dropout(a, self.p, self.training), pb


class T5LayerCrossAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.EncDecAttention = T5Attention(c, True, False)
        self.layer_norm = RMSNorm(c["d_model"], c["layer_norm_epsilon"])
        self.p = c["dropout_rate"]

    def forward(self, x, kv, mask, position_bias):
        a, pb = self.EncDecAttention(self.layer_norm(x), mask, kv=kv, position_bias=position_bias)
        return x + dropout(a, self.p, self.training), pb


class T5DenseActDense(nn.Module):
    def __init__(self, c, act):
        super().__init__()
        self.wi = nn.Linear(c["d_model"], c["d_ff"], bias=False)
        self.wo = nn.Linear(c["d_ff"], c["d_model"], bias=False)
        self.act, self.p = ACT[act], c["dropout_rate"]

    def forward(self, x):
        return self.wo(dropout(self.act(self.wi(x)), self.p, self.training))


class T5DenseGatedActDense(nn.Module):
    def __init__(self, c, act):
        super().__init__()
        self.wi_0 = nn.Linear(c["d_model"], c["d_ff"], bias=False)
        self.wi_1 = nn.Linear(c["d_model"], c["d_ff"], bias=False)
        self.wo = nn.Linear(c["d_ff"], c["d_model"], bias=False)
        self.act, self.p = ACT[act], c["dropout_rate"]

    def forward(self, x):
        h = self.act(self.wi_0(x)) * self.wi_1(x)
        return self.wo(dropout(h, self.p, self.training))


class T5LayerFF(nn.Module):
    def __init__(self, c):
        super().__init__()
        info = c["feed_forward_proj"].split("-")
        act = info[-1]
        if c["feed_forward_proj"] == "gated-gelu":
            act = "gelu_new"
        self.DenseReluDense = T5DenseGatedActDense(c, act) if info[0] == "gated" else T5DenseActDense(c, act)
        self.layer_norm = RMSNorm(c["d_model"], c["layer_norm_epsilon"])
        self.p = c["dropout_rate"]

    def forward(self, x):
        return x + dropout(self.DenseReluDense(self.layer_norm(x)), self.p, self.training)


class T5Block(nn.Module):
    def __init__(self, c, is_decoder, has_rab):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList([T5LayerSelfAttention(c, is_decoder, has_rab)])
        if is_decoder:
            self.layer.append(T5LayerCrossAttention(c))
        self.layer.append(T5LayerFF(c))

    def forward(self, x, mask, pb, enc=None, enc_mask=None, enc_pb=None):
        x, pb = self.layer[0](x, mask, pb)
        if self.is_decoder:
            x, enc_pb = self.layer[1](x, enc, enc_mask, enc_pb)
        return self.layer[-1](x), pb, enc_pb


class T5Stack(nn.Module):
    def __init__(self, c, embed_tokens, is_decoder):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.is_decoder = is_decoder
        n = c["num_decoder_layers"] if is_decoder else c["num_layers"]
        self.block = nn.ModuleList([T5Block(c, is_decoder, i == 0) for i in range(n)])
        self.final_layer_norm = RMSNorm(c["d_model"], c["layer_norm_epsilon"])
        self.p = c["dropout_rate"]

    def forward(self, ids, enc=None):
        h = dropout(self.embed_tokens(ids), self.p, self.training)
        t = ids.shape[1]
        mask = causal_mask(t) if self.is_decoder else torch.zeros(ids.shape[0], 1, 1, t)
        enc_mask = torch.zeros(ids.shape[0], 1, 1, enc.shape[1]) if enc is not None else None
        pb = enc_pb = None
        for blk in self.block:
            h, pb, enc_pb = blk(h, mask, pb, enc, enc_mask, enc_pb)
        return dropout(self.final_layer_norm(h), self.p, self.training)


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model_dim = c["d_model"]
        self.tie = c.get("tie_word_embeddings", True)
        self.shared = nn.Embedding(c["vocab_size"], c["d_model"])
        self.encoder = T5Stack(c, self.shared, False)
        self.decoder = T5Stack(c, self.shared, True)
        self.lm_head = nn.Linear(c["d_model"], c["vocab_size"], bias=False)
        if self.tie:
            self.lm_head.weight = self.shared.weight

    def forward(self, input_ids, decoder_input_ids, labels):
        enc = self.encoder(input_ids)
        h = self.decoder(decoder_input_ids, enc=enc)
        if self.tie:
            h = h * (self.model_dim ** -0.5)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


def _other_families():
    gpt2 = dict(model_type="gpt2", vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=None,
                activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                add_cross_attention=False, tie_word_embeddings=True, initializer_range=0.02)
    grx = r"^(transformer\.h\.\d+)(\.|$)"
    register("gpt2", "gpt2_tied", gpt2, GPT2LMHeadModel, grx)
    register("gpt2", "gpt2_dropout", dict(gpt2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1), GPT2LMHeadModel, grx)
    register("phi", "phi_partial_rotary", dict(model_type="phi", vocab_size=256, hidden_size=64, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, hidden_act="gelu_new",
                                               max_position_embeddings=128, layer_norm_eps=1e-5, tie_word_embeddings=False,
                                               rope_theta=10000.0, partial_rotary_factor=0.5, qk_layernorm=False),
             PhiForCausalLM, LLAMA_RX)
    register("phi3", "phi3_fused", dict(model_type="phi3", vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, resid_pdrop=0.0,
                                        embd_pdrop=0.0, attention_dropout=0.0, hidden_act="silu", max_position_embeddings=128,
                                        original_max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                                        rope_scaling=None, partial_rotary_factor=1.0, sliding_window=None,
                                        tie_word_embeddings=False), Phi3ForCausalLM, LLAMA_RX)
    register("gpt_neox", "gpt_neox_parallel", dict(model_type="gpt_neox", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=256, hidden_act="gelu",
                                                   rotary_pct=0.25, rotary_emb_base=10000, attention_dropout=0.0,
                                                   hidden_dropout=0.0, max_position_embeddings=128, layer_norm_eps=1e-5,
                                                   use_parallel_residual=True, attention_bias=True, tie_word_embeddings=False),
             GPTNeoXForCausalLM, r"^(gpt_neox\.layers\.\d+)(\.|$)")
    opt = dict(model_type="opt", vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
               activation_function="relu", max_position_embeddings=64, do_layer_norm_before=True, word_embed_proj_dim=64,
               dropout=0.0, attention_dropout=0.0, layerdrop=0.0, enable_bias=True, layer_norm_elementwise_affine=True,
               _remove_final_layer_norm=False, tie_word_embeddings=True, pad_token_id=1)
    orx = r"^(model\.decoder\.layers\.\d+)(\.|$)"
    register("opt", "opt_tied", opt, OPTForCausalLM, orx)
    register("opt", "opt_project_in_out", dict(opt, word_embed_proj_dim=32), OPTForCausalLM, orx)
    fal = dict(model_type="falcon", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
               layer_norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0, bias=False, alibi=False,
               max_position_embeddings=128, rope_theta=10000.0, rope_scaling=None, ffn_hidden_size=256, activation="gelu",
               tie_word_embeddings=True)
    frx = r"^(transformer\.h\.\d+)(\.|$)"
    register("falcon", "falcon_new_arch_gqa", dict(fal, new_decoder_architecture=True, num_kv_heads=2, multi_query=True,
                                                   parallel_attn=True, num_ln_in_parallel_attn=None), FalconForCausalLM, frx)
    register("falcon", "falcon_mqa_parallel", dict(fal, new_decoder_architecture=False, num_kv_heads=None, multi_query=True,
                                                   parallel_attn=True, num_ln_in_parallel_attn=None), FalconForCausalLM, frx)
    register("bloom", "bloom_alibi", dict(model_type="bloom", vocab_size=256, hidden_size=64, n_layer=2, n_head=8,
                                          layer_norm_epsilon=1e-5, apply_residual_connection_post_layernorm=False,
                                          hidden_dropout=0.0, attention_dropout=0.0, pretraining_tp=1, slow_but_exact=False,
                                          tie_word_embeddings=True), BloomForCausalLM, r"^(transformer\.h\.\d+)(\.|$)")
    t5 = dict(model_type="t5", vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
              layer_norm_epsilon=1e-6, feed_forward_proj="relu", is_encoder_decoder=True, tie_word_embeddings=True,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    trx = r"^((?:encoder|decoder)\.block\.\d+)(\.|$)"
    register("t5", "t5_relu_tied", t5, T5ForConditionalGeneration, trx)
    register("t5", "t5_gated_gelu_untied", dict(t5, feed_forward_proj="gated-gelu", tie_word_embeddings=False, d_kv=8,
                                                num_decoder_layers=3), T5ForConditionalGeneration, trx)


EXTRA_REGISTRATIONS.append(_other_families)


# =============================================================================
# BERT (post-LN encoder; sequence-classification, masked-LM and pretraining heads)
# Written from huggingface/transformers src/transformers/models/bert/modeling_bert.py (commit
# 8ec58104: BertEmbeddings, BertSelfAttention (eager), BertSelfOutput, BertIntermediate,
# BertOutput, BertPooler, BertPredictionHeadTransform, BertLMPredictionHead,
# BertForSequenceClassification, BertForMaskedLM, BertForPreTraining) and configuration_bert.py.
# =============================================================================
def bert_num_labels(c):
    """PretrainedConfig.__init__: id2label decides when present, else num_labels (default 2)."""
    if c.get("id2label") is not None:
        return len(c["id2label"])
    return c.get("num_labels", 2)


class BertEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.word_embeddings = nn.Embedding(c["vocab_size"], H, padding_idx=c.get("pad_token_id", 0))
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], H)
        self.token_type_embeddings = nn.Embedding(c["type_vocab_size"], H)
        self.LayerNorm = nn.LayerNorm(H, eps=c["layer_norm_eps"])
        self.p = c["hidden_dropout_prob"]
        # registered buffers, sliced in forward (not activations)
        self.register_buffer("position_ids", torch.arange(c["max_position_embeddings"]).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long), persistent=False)

    def forward(self, ids):
        b, t = ids.shape
        position_ids = self.position_ids[:, :t]
        token_type_ids = self.token_type_ids[:, :t].expand(b, t)
        e = self.word_embeddings(ids) + self.token_type_embeddings(token_type_ids)
        e += self.position_embeddings(position_ids)
        return dropout(self.LayerNorm(e), self.p, self.training)


class BertSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh = c["hidden_size"], c["num_attention_heads"]
        self.nh, self.hd = nh, H // nh
        self.query = nn.Linear(H, H)
        self.key = nn.Linear(H, H)
        self.value = nn.Linear(H, H)
        self.p = c["attention_probs_dropout_prob"]

    def _split(self, x):
        return x.view(x.size()[:-1] + (self.nh, self.hd)).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        q = self._split(self.query(x))
        k = self._split(self.key(x))
        v = self._split(self.value(x))
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / math.sqrt(self.hd)
        w = w + mask  # extended padding mask (B,1,1,T): bidirectional
        w = F.softmax(w, dim=-1)
        w = dropout(w, self.p, self.training)
        o = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous()
        return o.view(o.size()[:-2] + (self.nh * self.hd,))


class BertSelfOutput(nn.Module):  # also BertOutput (dense from intermediate_size)
    def __init__(self, c, d_in):
        super().__init__()
        self.dense = nn.Linear(d_in, c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.p = c["hidden_dropout_prob"]

    def forward(self, h, x):
        return self.LayerNorm(dropout(self.dense(h), self.p, self.training) + x)


class BertAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c, c["hidden_size"])

    def forward(self, x, mask):
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])
        self.act = ACT[c["hidden_act"]]

    def forward(self, x):
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertSelfOutput(c, c["intermediate_size"])

    def forward(self, x, mask):
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(c) for _ in range(c["num_hidden_layers"])])

    def forward(self, x, mask):
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertPooler(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.activation = nn.Tanh()

    def forward(self, h):
        return self.activation(self.dense(h[:, 0]))


class BertModel(nn.Module):
    def __init__(self, c, add_pooling_layer=True):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c) if add_pooling_layer else None

    def forward(self, ids):
        b, t = ids.shape
        am = torch.ones(b, t)  # no padding; get_extended_attention_mask
        mask = (1.0 - am[:, None, None, :]) * torch.finfo(torch.float32).min
        h = self.encoder(self.embeddings(ids), mask)
        return h, (self.pooler(h) if self.pooler is not None else None)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.act = ACT[c["hidden_act"]]
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])

    def forward(self, h):
        return self.LayerNorm(self.act(self.dense(h)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transform = BertPredictionHeadTransform(c)
        self.decoder = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.bias = nn.Parameter(torch.zeros(c["vocab_size"]))
        self.decoder.bias = self.bias

    def forward(self, h):
        return self.decoder(self.transform(h))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.predictions = BertLMPredictionHead(c)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.predictions = BertLMPredictionHead(c)
        self.seq_relationship = nn.Linear(c["hidden_size"], 2)


class BertForSequenceClassification(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_labels = bert_num_labels(c)
        self.bert = BertModel(c)
        cd = c.get("classifier_dropout")
        self.p = cd if cd is not None else c["hidden_dropout_prob"]
        self.classifier = nn.Linear(c["hidden_size"], self.num_labels)

    def forward(self, input_ids, labels):
        _, pooled = self.bert(input_ids)
        logits = self.classifier(dropout(pooled, self.p, self.training))
        return F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))


class BertForMaskedLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.V = c["vocab_size"]
        self.bert = BertModel(c, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(c)
        if c.get("tie_word_embeddings", True):
            self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, labels):
        h, _ = self.bert(input_ids)
        scores = self.cls.predictions(h)
        return F.cross_entropy(scores.view(-1, self.V), labels.view(-1))


class BertForPreTraining(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.V = c["vocab_size"]
        self.bert = BertModel(c)
        self.cls = BertPreTrainingHeads(c)
        if c.get("tie_word_embeddings", True):
            self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, labels, next_sentence_label):
        h, pooled = self.bert(input_ids)
        scores = self.cls.predictions(h)
        nsp = self.cls.seq_relationship(pooled)
        mlm_loss = F.cross_entropy(scores.view(-1, self.V), labels.view(-1))
        return mlm_loss + F.cross_entropy(nsp.view(-1, 2), next_sentence_label.view(-1))


def bert_inputs(c, g):
    """Token ids and the head's labels: a class per sequence (sequence classification), the
    original token at every 4th position and -100 elsewhere (masked LM), plus next-sentence
    labels (pretraining)."""
    V = c["vocab_size"]
    ids = torch.randint(0, V, (B, T), generator=g)
    arch = c["architectures"][0]
    if arch == "BertForSequenceClassification":
        labels = torch.randint(0, bert_num_labels(c), (B,), generator=g)
        kw = {"input_ids": ids, "labels": labels}
        return kw, dict(kw)
    labels = ids.masked_fill(torch.arange(T)[None, :] % 4 != 0, -100)
    kw = {"input_ids": ids, "labels": labels}
    if arch == "BertForPreTraining":
        kw["next_sentence_label"] = torch.randint(0, 2, (B,), generator=g)
    return kw, dict(kw)


BERT_ARCH = {"BertForSequenceClassification": BertForSequenceClassification, "BertForMaskedLM": BertForMaskedLM,
             "BertForPreTraining": BertForPreTraining}


def build_bert(c):
    return BERT_ARCH[c["architectures"][0]](c)


def _bert_family():
    base = dict(model_type="bert", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=256, hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                max_position_embeddings=64, type_vocab_size=2, initializer_range=0.02, layer_norm_eps=1e-12,
                pad_token_id=0, position_embedding_type="absolute", use_cache=True, classifier_dropout=None)
    brx = r"^(bert\.encoder\.layer\.\d+)(\.|$)"
    register("bert", "bert_seqcls_3labels", dict(base, architectures=["BertForSequenceClassification"],
                                                  id2label={"0": "neg", "1": "neu", "2": "pos"},
                                                  label2id={"neg": 0, "neu": 1, "pos": 2}), build_bert, brx)
    register("bert", "bert_seqcls_dropout", dict(base, architectures=["BertForSequenceClassification"], num_labels=5,
                                                  hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                                                  classifier_dropout=0.2), build_bert, brx)
    register("bert", "bert_mlm_tied", dict(base, architectures=["BertForMaskedLM"]), build_bert, brx)
    register("bert", "bert_pretraining", dict(base, architectures=["BertForPreTraining"], type_vocab_size=3),
             build_bert, brx)


EXTRA_REGISTRATIONS.append(_bert_family)


# ==== MAIN ====
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "models", "torch_reference.json")


def main(argv):
    t0 = time.time()
    checked = gradcheck_custom_functions()
    build_registry()
    want = [a for a in argv if not a.startswith("--")]
    write = "--write" in argv or not want
    configs = []
    for fam, entries in FAMILIES.items():
        if want and fam not in want:
            continue
        for name, cfg, builder, rx in entries:
            t1 = time.time()
            r = run_one(fam, name, cfg, builder, rx)
            configs.append(r)
            st = r["saved_totals"]
            print(f"{fam:12s} {name:24s} params={r['total']:8d} saved={st['total_bytes']:9d}B "
                  f"outside={st['outside_blocks']:8d}B n={st['num_saved']:4d} ({time.time() - t1:.2f}s)")
    by_name = {name: cfg for entries in FAMILIES.values() for name, cfg, _, _ in entries}
    loss_path = [run_loss_path(name, by_name[name], dt) for name, dt in LOSS_PATH_RUNS]
    for r in loss_path:
        print(f"loss path    {r['config']:24s} {r['dtype']:4s} saved={sum(x[5] for x in r['saved'] if x[6] == 'act')}B "
              f"grads={sum(x[3] for x in r['grads'])}B")
    payload = {
        "description": "Independent PyTorch reference (tests/models/torch_reference.py): HF-named parameter inventories and autograd-saved activation tensors for small configs of each supported HF model family.",
        "generator": {"script": "tests/models/torch_reference.py", "torch": torch.__version__, "gradcheck_passed": checked},
        "conventions": CONVENTIONS,
        "configs": configs,
        "loss_path": {"about": LOSS_PATH_ABOUT, "runs": loss_path},
    }
    if write:
        n = dump_fixture(os.path.normpath(FIXTURE), payload)
        print(f"wrote {os.path.normpath(FIXTURE)} ({n} bytes)")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
