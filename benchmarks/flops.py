"""Floating-point operations of one PPO update of `ppo.py`, counted from the model config (stdlib only).

Only matrix products are counted (2 FLOPs per multiply-add); norms, activations, softmax, the optimizer and the
loss maths are left out (a few percent at most for these models). For a Llama-style decoder with L layers, hidden
H, intermediate I, n query heads and m KV heads of width d, vocab V:

  N     = L * (H*n*d + 2*H*m*d + n*d*H + 3*H*I)   matrix weights of the layers (embeddings are a lookup: no FLOPs)
  attn  = 4 * L * n * d * S(S+1)/2                QK^T and AV of one causal sequence of S tokens (what the maths
                                                  needs; a masked kernel may compute the full S x S)
  fwd(S, R) = 2*N*S + attn(S) + 2*V*H*R           one forward of S tokens with the LM head on R positions
                                                  (value/reward heads, V = 1, are negligible and left out)

With B rollouts per update, query Q, response T, S = Q + T, E PPO epochs, policy and value model of the same
backbone (as in the benchmark: value = reward model = the policy's backbone + a scalar head):

  generation = B * [2*N*(S-1) + attn(S-1) + 2*V*H*T]  prefill of Q tokens + T-1 cached decoding steps, LM head on
                                                      the last position of each of the T forwards
  scoring    = B * [2*fwd(S, T) + 2*fwd(S, 0)]         policy and ref (LM head on the T response-predicting
                                                      positions, as ppo.py does), value and reward
  training   = E * B * 3 * [fwd(S, T) + fwd(S, 0)]    forward + backward (backward = 2x forward) of policy and
                                                      value on every rollout in every epoch

Shorthand for the training phase: ~ 6 * (N_policy + N_value) * S * B * E tokens-FLOPs, plus the LM head's
6*V*H*T*B*E and the attention term (both counted here). The achieved rate of a phase = its FLOPs / its seconds,
and the MFU = that / the peak of `peak_flops.py` (the large square product, the best the hardware showed).
"""


def layer_weights(config):
    """N: matrix weights of the decoder layers, from a Llama-style config dict."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)


def attention(config, seq):
    """QK^T and AV FLOPs of one causal sequence of `seq` tokens, all layers."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 4 * config["num_hidden_layers"] * heads * head_dim * seq * (seq + 1) // 2


def forward(config, seq, head_rows):
    """One forward of `seq` tokens with the LM head on `head_rows` positions."""
    return 2 * layer_weights(config) * seq + attention(config, seq) + \
        2 * config["vocab_size"] * config["hidden_size"] * head_rows


def ppo_update(config, rollouts, query_len, response_len, epochs):
    """FLOPs of one update by phase: {"generation", "scoring", "training", "total"} (ints), plus "formula"."""
    seq = query_len + response_len
    n = layer_weights(config)
    generation = rollouts * (2 * n * (seq - 1) + attention(config, seq - 1)
                             + 2 * config["vocab_size"] * config["hidden_size"] * response_len)
    scoring = rollouts * (2 * forward(config, seq, response_len) + 2 * forward(config, seq, 0))
    training = epochs * rollouts * 3 * (forward(config, seq, response_len) + forward(config, seq, 0))
    return {"generation": generation, "scoring": scoring, "training": training,
            "total": generation + scoring + training, "layer_weights": n,
            "formula": "benchmarks/flops.py: matrix products only; training = E*B*3*(fwd_policy + fwd_value)"}


def rates(flops, phase_s, peak_tflops):
    """Achieved TFLOP/s and fraction of `peak_tflops` per phase, for phases timed in `phase_s` ({"generation",
    "scoring", "training", "update"} seconds; "update" is held against the total)."""
    out = {}
    for phase, seconds in phase_s.items():
        key = "total" if phase == "update" else phase
        if key not in flops or not seconds:
            continue
        tflops = flops[key] / seconds / 1e12
        out[phase] = {"tflops": round(tflops, 4), "fraction_of_peak": round(tflops / peak_tflops, 4)
                      if peak_tflops else None}
    return out
