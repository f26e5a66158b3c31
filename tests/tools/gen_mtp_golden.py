#!/usr/bin/env python3
"""gen_mtp_golden.py - float64 numpy reference of the MTP (next-token prediction) layer's logits.

transformers has no MTP implementation, so the reference is built here from the layer's
definition, as vLLM's DeepSeekMultiTokenPredictorLayer runs it (the engine's version:
model_mtp_forward in engine/model/model.c):

    e      = RMSNorm(embed_tokens[token_{p+1}], enorm)     (embedding zeroed at position p == 0)
    hh     = RMSNorm(h_main[p], hnorm)
    z      = eh_proj(concat[e, hh])                         (order: embedding, then hidden)
    z      = decoder layer n_layers (MLA + its own full DSA indexer + MoE + shared expert)
    logits = lm_head(RMSNorm(z, shared_head.norm))          (the main lm_head: no shared_head.head)

h_main[p] is the main model's hidden state AFTER its final norm (model.norm): vLLM's
DeepseekV2Model.forward returns `hidden_states, _ = self.norm(hidden_states, residual)`, and that
is what vLLM's MTP proposer receives as previous_hidden_states. The MTP layer attends over its
own cache of the earlier positions' MTP inputs, with the same RoPE positions p as the main model.

Usage:
  gen_mtp_golden.py --model tests/golden/models/mtp_theta --out tests/golden/mtp
      Reads the checkpoint and golden.json's prompt (numpy only), runs the main model in float64
      for h_main, then the MTP layer over rows p = 0 .. T-2 (h_main[p], token[p+1]). Writes
      <name>.json (tokens, shapes, summary) and <name>_logits.f32 (float32 LE [T-1, vocab]).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_golden_models as g  # noqa: E402


def np_layer(a, W, L, h, full_indexer, sparse):
    """One decoder layer in float64 over rows h [T, hidden] at positions 0..T-1."""
    T = h.shape[0]
    nh = a["num_attention_heads"]
    nope, rd, vd = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
    qk = nope + rd
    eps = a["rms_norm_eps"]
    cos, sin = g.rope_tables(a, T)
    causal = np.tril(np.ones((T, T), dtype=bool))
    p = f"model.layers.{L}."
    x = g.rms(h, W[p + "input_layernorm.weight"], eps)
    q_resid = g.rms(x @ W[p + "self_attn.q_a_proj.weight"].T,
                    W[p + "self_attn.q_a_layernorm.weight"], 1e-6)
    q = (q_resid @ W[p + "self_attn.q_b_proj.weight"].T).reshape(T, nh, qk)
    q_pass, q_rot = q[..., :nope], q[..., nope:]
    ckv = x @ W[p + "self_attn.kv_a_proj_with_mqa.weight"].T
    kv_pass, k_rot = ckv[:, :a["kv_lora_rank"]], ckv[:, a["kv_lora_rank"]:]
    k_pass = g.rms(kv_pass, W[p + "self_attn.kv_a_layernorm.weight"], 1e-6)
    q_rot = g.rope_interleave(q_rot, cos[:, None, :], sin[:, None, :])
    k_rot = g.rope_interleave(k_rot, cos, sin)
    query = np.concatenate([q_pass, q_rot], axis=-1)
    kv = (k_pass @ W[p + "self_attn.kv_b_proj.weight"].T).reshape(T, nh, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    key = np.concatenate([k_nope, np.broadcast_to(k_rot[:, None, :], (T, nh, rd))], axis=-1)
    sel = np.ones((T, T), dtype=bool)
    margins = []
    if full_indexer and a["index_topk"] > 0:
        D, nih = a["index_head_dim"], a["index_n_heads"]
        iq = (q_resid @ W[p + "self_attn.indexer.wq_b.weight"].T).reshape(T, nih, D)
        ik = g.layernorm(x @ W[p + "self_attn.indexer.wk.weight"].T,
                         W[p + "self_attn.indexer.k_norm.weight"],
                         W[p + "self_attn.indexer.k_norm.bias"], 1e-6)
        iq = np.concatenate([g.rope_interleave(iq[..., :rd], cos[:, None, :], sin[:, None, :]),
                             iq[..., rd:]], axis=-1)
        ik = np.concatenate([g.rope_interleave(ik[..., :rd], cos, sin), ik[..., rd:]], axis=-1)
        sc = np.maximum(np.einsum("shd,td->sht", iq, ik) * D ** -0.5, 0.0)
        wts = (x @ W[p + "self_attn.indexer.weights_proj.weight"].T) * nih ** -0.5
        iscore = np.einsum("sh,sht->st", wts, sc)
        k = a["index_topk"]
        sel = np.zeros((T, T), dtype=bool)
        for s in range(T):
            vis = iscore[s, : s + 1]
            if s + 1 > k:
                order = np.argsort(-vis, kind="stable")
                sel[s, np.sort(order[:k])] = True
                margins.append(g.rel_gap(vis[order], k))
            else:
                sel[s, : s + 1] = True
    mask = causal & sel
    scores = np.einsum("shd,thd->hst", query, key) * qk ** -0.5
    scores = np.where(mask[None], scores, -np.inf)
    pr = g.softmax(scores, axis=-1)
    o = np.einsum("hst,thd->shd", pr, v).reshape(T, nh * vd)
    h = h + o @ W[p + "self_attn.o_proj.weight"].T
    x = g.rms(h, W[p + "post_attention_layernorm.weight"], eps)
    tr = {"route_margins": [], "group_margins": [], "router_sel": {}}
    if sparse:
        y = g.moe(a, W, p, x, tr, L)
    else:
        y = (g.silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)
             ) @ W[p + "mlp.down_proj.weight"].T
    margins += [m[0] for m in tr["route_margins"] + tr["group_margins"]]
    return h + y, margins


def mtp_forward(a, W, h_main, next_tokens):
    """MTP logits [T, V] and output hidden [T, hidden] for rows p = 0..T-1."""
    L = a["num_hidden_layers"]
    p = f"model.layers.{L}."
    eps = a["rms_norm_eps"]
    e = W["model.embed_tokens.weight"][np.asarray(next_tokens)].copy()
    e[0] = 0.0  # vLLM: inputs_embeds[positions == 0] = 0
    z = np.concatenate([g.rms(e, W[p + "enorm.weight"], eps),
                        g.rms(h_main, W[p + "hnorm.weight"], eps)], axis=-1)
    z = z @ W[p + "eh_proj.weight"].T
    z, margins = np_layer(a, W, L, z, True, True)
    logits = g.rms(z, W[p + "shared_head.norm.weight"], eps) @ W["lm_head.weight"].T
    return logits, z, margins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    name = os.path.basename(os.path.normpath(args.model))
    with open(os.path.join(args.model, "config.json")) as f:
        c = json.load(f)
    with open(os.path.join(args.model, "golden.json")) as f:
        gold = json.load(f)
    a = g.arch_from_config_json(c)
    assert a["mtp_layers"] >= 1, "the model has no MTP layer"
    W = g.weights_from_files(c, g.load_checkpoint_files(args.model))
    if "lm_head.weight" not in W:
        W["lm_head.weight"] = W["model.embed_tokens.weight"]
    tokens = gold["tokens"]
    tr = {}
    main_logits = g.np_forward(a, W, tokens, tr)
    h_main = tr["hidden"][-1]  # after model.norm
    logits, z, margins = mtp_forward(a, W, h_main[:-1], tokens[1:])
    os.makedirs(args.out, exist_ok=True)
    lf = f"{name}_logits.f32"
    logits.astype("<f4").tofile(os.path.join(args.out, lf))
    summ = {
        "model": name,
        "tokens": tokens,
        "rows": len(tokens) - 1,
        "vocab_size": a["vocab_size"],
        "logits_file": lf,
        "definition": "row p: MTP(h_main[p] after model.norm, token[p+1]) at position p; "
                      "embedding zeroed at position 0",
        "max_abs_logit": float(np.max(np.abs(logits))),
        "min_rel_margin": float(min(margins)) if margins else None,
        "mtp_argmax": [int(i) for i in np.argmax(logits, axis=-1)],
        "main_argmax": [int(i) for i in np.argmax(main_logits, axis=-1)],
    }
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(summ, f, indent=1)
        f.write("\n")
    agree = sum(int(x == y) for x, y in zip(summ["mtp_argmax"], summ["main_argmax"][1:]))
    print(f"{name}: {summ['rows']} MTP rows, max|logit| {summ['max_abs_logit']:.4g}, "
          f"min selection margin {summ['min_rel_margin']}, MTP argmax == main argmax of the "
          f"next position in {agree}/{summ['rows']} rows")


if __name__ == "__main__":
    main()
