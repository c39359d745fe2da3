"""An independent, naive re-implementation of the tiny model's full-prefill forward.

One request at a time, no caches, no CP, per-token Python loops, written straight from
attention-math.md (§3, §4.2–§4.7, §5) without importing dsv4cp's ops. It reads the weights by
their checkpoint names, so it shares nothing with the model's code but the config.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dsv4cp.config import DeepseekV41Config


def _rms(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * w.double() if w is not None else y


def _freqs(cfg: DeepseekV41Config, ratio: int) -> list[float]:
    dr = cfg.qk_rope_head_dim
    if ratio == 0:
        theta = cfg.rope_theta
        return [theta ** (-2 * i / dr) for i in range(dr // 2)]
    theta, y = cfg.compress_rope_theta, cfg.rope_scaling
    base = [theta ** (-2 * i / dr) for i in range(dr // 2)]
    if y is None:
        return base

    def corr(n: float) -> float:
        return dr * math.log(y.original_max_position / (n * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(corr(y.beta_fast)), 0)
    hi = min(math.ceil(corr(y.beta_slow)), dr - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for i, w in enumerate(base):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(w / y.factor * ramp + w * (1 - ramp))
    return out


def _rope(v: Tensor, pos: int, freqs: list[float], inverse: bool = False) -> Tensor:
    """Rotate the last 2·len(freqs) dims of v (any leading dims) in interleaved pairs."""
    v = v.clone().double()
    dr = 2 * len(freqs)
    base = v.shape[-1] - dr
    for i, w in enumerate(freqs):
        # The model forms angles in fp32 (attention-math §3); do the same for a fair comparison.
        ang = float(torch.tensor(pos, dtype=torch.float32) * torch.tensor(w, dtype=torch.float32))
        c, s = math.cos(ang), math.sin(ang) * (-1 if inverse else 1)
        a, b = v[..., base + 2 * i].clone(), v[..., base + 2 * i + 1].clone()
        v[..., base + 2 * i] = a * c - b * s
        v[..., base + 2 * i + 1] = a * s + b * c
    return v


def reference_logits(
    cfg: DeepseekV41Config, weights: dict[str, Tensor], tokens: list[int]
) -> Tensor:
    """fp64 logits [S, V] of one prompt processed in one full prefill."""
    w = {k: v.double() for k, v in weights.items()}
    eps, S = cfg.rms_norm_eps, len(tokens)
    H, D, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    h = w["embed.weight"][torch.tensor(tokens)]
    comp_keys: dict[int, list[Tensor]] = {}
    index_keys: dict[int, list[Tensor]] = {}
    selection: dict[int, list[list[int]]] = {}
    candidates: dict[int, list[list[int]]] = {}
    for i in range(cfg.num_hidden_layers):
        role = cfg.layer_role(i)
        r = role.ratio
        f = _freqs(cfg, r)
        p = f"layers.{i}.attn."
        xn = _rms(h, w[f"layers.{i}.attn_norm.weight"], eps)
        q_lora = _rms(xn @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], eps)
        kv_raw = xn @ w[p + "wkv.weight"].T
        q = (q_lora @ w[p + "wq_b.weight"].T).view(S, H, D)
        q = torch.stack([_rope(q[t], t, f) for t in range(S)])
        k_swa = torch.stack(
            [_rope(_rms(kv_raw[t], w[p + "kv_norm.weight"], eps), t, f) for t in range(S)]
        )
        if role.owns_compressor:
            kv = xn @ w[p + "compressor.wkv.weight"].T
            if r == 2:
                g = xn @ w[p + "compressor.wgate.weight"].T
                lat = []
                for j in range(S // 2):
                    e = torch.softmax(torch.stack([g[2 * j], g[2 * j + 1]]), dim=0)
                    lat.append(
                        _rms(
                            e[0] * kv[2 * j] + e[1] * kv[2 * j + 1],
                            w[p + "compressor.norm.weight"],
                            eps,
                        )
                    )
            else:
                lat = [_rms(kv[t], w[p + "compressor.norm.weight"], eps) for t in range(S)]
            comp_keys[i] = [_rope(L, j * r, f) for j, L in enumerate(lat)]
            index_keys[i] = [
                _rope(
                    _rms(L @ w[p + "indexer.wk.weight"].T, w[p + "indexer.k_norm.weight"], eps),
                    j * r,
                    f,
                )
                for j, L in enumerate(lat)
            ]
        if role.index_source:
            qi = (q_lora @ w[p + "indexer.wq_b.weight"].T).view(S, HI, DI)
            hw = (xn @ w[p + "indexer.weights_proj.weight"].T) * DI**-0.5 * HI**-0.5
            keys = index_keys[role.kv_source]
            sel, cands = [], []
            for t in range(S):
                n = (t + 1) // r
                qt = _rope(qi[t], t, f)
                logit = [
                    sum(float(hw[t, hh]) * max(float(qt[hh] @ keys[j]), 0.0) for hh in range(HI))
                    for j in range(n)
                ]
                allowed = list(range(n))
                if role.candidate_consumer:
                    blocks = set(candidates[r][t])
                    allowed = [j for j in allowed if j // cfg.candidate_block_size in blocks]
                if len(allowed) <= cfg.index_topk:
                    pick = allowed
                else:
                    pick = sorted(allowed, key=lambda j: -logit[j])[: cfg.index_topk]
                sel.append(sorted(pick))
                if role.candidate_source:
                    bs = cfg.candidate_block_size
                    nb = -(-n // bs)
                    score = [max(logit[b * bs : min(n, (b + 1) * bs)]) for b in range(nb)]
                    if nb:
                        score[nb - 1] = math.inf
                    keep = sorted(range(nb), key=lambda b: -score[b])[: cfg.candidate_topk_blocks]
                    cands.append(sorted(keep))
            selection[r] = sel
            if role.candidate_source:
                candidates[r] = cands
        out = torch.zeros(S, H, D, dtype=torch.float64)
        sink = w[p + "attn_sink"]
        for t in range(S):
            keys = [k_swa[s] for s in range(max(0, t - W + 1), t + 1)]
            if r:
                keys += [comp_keys[role.kv_source][j] for j in selection[r][t]]
            kmat = torch.stack(keys)
            for hh in range(H):
                s = (kmat @ q[t, hh]) * D**-0.5
                m = max(float(s.max()), float(sink[hh]))
                e = torch.exp(s - m)
                out[t, hh] = (e[:, None] * kmat).sum(0) / (e.sum() + math.exp(float(sink[hh]) - m))
            out[t] = _rope(out[t], t, f, inverse=True)
        G, Ro = cfg.o_groups, cfg.o_lora_rank
        wa = w[p + "wo_a.weight"].view(G, Ro, -1)
        grouped = out.reshape(S, G, -1)
        z = torch.stack([grouped[:, g] @ wa[g].T for g in range(G)], dim=1).reshape(S, G * Ro)
        h = h + z @ w[p + "wo_b.weight"].T
        fn = _rms(h, w[f"layers.{i}.ffn_norm.weight"], eps)
        a = fn @ w[f"layers.{i}.ffn.w1.weight"].T
        b = fn @ w[f"layers.{i}.ffn.w3.weight"].T
        h = h + (torch.nn.functional.silu(a) * b) @ w[f"layers.{i}.ffn.w2.weight"].T
    return _rms(h, w["norm.weight"], eps) @ w["head.weight"].T
