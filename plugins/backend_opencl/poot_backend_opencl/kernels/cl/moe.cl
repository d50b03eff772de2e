// Mixture-of-experts routing and accumulation. EXPERTS is defined by the host.

// weights[t, :] = the routing weights of token t over EXPERTS (0 for experts not chosen), as
// poot_core.moe.choose_experts: softmax or sigmoid scores; the correction bias shifts the choice only; with
// groups > 1 only the best topk_groups groups (by their best score, or the sum of their two best) are
// eligible; the chosen weights renormalized when norm, then times routed_scale. One work-item per token.
kernel void moe_route(global const float* logits, global const float* bias, int has_bias, global float* weights,
                      int tokens, int top_k, int sigmoid_scores, int groups, int topk_groups, int group_top2,
                      int norm, float routed_scale) {
    int t = get_global_id(0);
    if (t >= tokens) return;
    global const float* lr = logits + (size_t)t * EXPERTS;
    float score[EXPERTS], choice[EXPERTS];
    float top = -INFINITY;
    for (int e = 0; e < EXPERTS; e++) top = fmax(top, lr[e]);
    float total = 0.0f;
    for (int e = 0; e < EXPERTS; e++) {
        score[e] = sigmoid_scores ? 1.0f / (1.0f + exp(-lr[e])) : exp(lr[e] - top);
        total += score[e];
    }
    for (int e = 0; e < EXPERTS; e++) {
        if (!sigmoid_scores) score[e] /= total;
        choice[e] = score[e] + (has_bias ? bias[e] : 0.0f);
    }
    if (groups > 1) {
        int per = EXPERTS / groups;
        float group_score[EXPERTS];
        for (int g = 0; g < groups; g++) {
            float first = -INFINITY, second = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                if (choice[e] > first) { second = first; first = choice[e]; }
                else if (choice[e] > second) second = choice[e];
            }
            group_score[g] = group_top2 ? first + second : first;
        }
        for (int k = 0; k < topk_groups; k++) {  // mark the best groups with +inf, lowest index on ties
            int best = -1;
            for (int g = 0; g < groups; g++)
                if (group_score[g] != INFINITY && (best < 0 || group_score[g] > group_score[best])) best = g;
            group_score[best] = INFINITY;
        }
        for (int e = 0; e < EXPERTS; e++)
            if (group_score[e / per] != INFINITY) choice[e] = -INFINITY;
    }
    global float* w = weights + (size_t)t * EXPERTS;
    for (int e = 0; e < EXPERTS; e++) w[e] = 0.0f;
    float chosen_sum = 0.0f;
    int ids[EXPERTS];
    for (int k = 0; k < top_k; k++) {
        int best = -1;
        for (int e = 0; e < EXPERTS; e++)
            if (best < 0 || choice[e] > choice[best]) best = e;
        ids[k] = best;
        chosen_sum += score[best];
        choice[best] = -INFINITY;
    }
    for (int k = 0; k < top_k; k++) {
        float value = score[ids[k]];
        if (norm) value /= chosen_sum + 1e-20f;
        w[ids[k]] = value * routed_scale;
    }
}

// mode 0: out += weights[t, col] * y; 1: out = weights[t, col] * y; 2: out += sigmoid(weights[t, col]) * y;
// 3: out += y. Rows of `width` floats, `tokens` rows.
kernel void moe_accumulate(global const float* weights, int stride, int col, global const float* y,
                           global float* out, int width, int tokens, int mode) {
    int i = get_global_id(0), t = get_global_id(1);
    if (i >= width || t >= tokens) return;
    size_t at = (size_t)t * width + i;
    float w = mode == 3 ? 1.0f : weights[t * stride + col];
    if (mode == 2) w = 1.0f / (1.0f + exp(-w));
    float value = w == 0.0f ? 0.0f : w * y[at];
    out[at] = mode == 1 ? value : out[at] + value;
}
