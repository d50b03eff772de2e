// Causal attention of each query token over the KV cache [capacity, kv_heads, head_dim], keys cut into splits:
// one work-group per (split, head, token) writes its partial softmax (max, sum, weighted values) and
// attention_combine merges a query's splits. Query t sits at positions[0] + t and sees keys up to it (and no
// further back than `window` when window > 0); scores are scaled, then soft-capped when softcap > 0.
// DIMS = values per work-item (head_dim <= DIMS * GROUP). VEC4 (head_dim a multiple of 4): a key's dot reads
// its row 16 bytes a load.

kernel void attention_split(global const float* q, global const float* kc, global const float* vc,
                            global const uint* positions, global float* part, int heads, int kv_heads,
                            int head_dim, int split_len, int splits, float scale, int window, float softcap) {
    int s = get_group_id(0), h = get_group_id(1), t = get_group_id(2), lid = get_local_id(0);
#if VEC4
    local float4 qv4[DIMS * GROUP / 4];
    local float* qv = (local float*)qv4;
#else
    local float qv[DIMS * GROUP];
#endif
    local float p[GROUP];
    local float scratch[GROUP];
    int pos = (int)positions[0] + t;
    int kvh = h / (heads / kv_heads);
    int lo = s * split_len, hi = min(lo + split_len, pos + 1);
    if (window > 0) lo = max(lo, pos - window + 1);
    global const float* qr = q + ((size_t)t * heads + h) * head_dim;
    for (int d = lid; d < head_dim; d += GROUP) qv[d] = qr[d];
    barrier(CLK_LOCAL_MEM_FENCE);
    float m = -INFINITY, l = 0.0f, acc[DIMS];
    for (int j = 0; j < DIMS; j++) acc[j] = 0.0f;
    size_t stride = (size_t)kv_heads * head_dim;
    for (int base = lo; base < hi; base += GROUP) {
        int k = base + lid;
        float score = -INFINITY;
        if (k < hi) {
            global const float* kr = kc + k * stride + kvh * head_dim;
            float sum = 0.0f;
#if VEC4
            global const float4* kr4 = (global const float4*)kr;
            for (int d = 0; d < head_dim / 4; d++) sum += dot(qv4[d], kr4[d]);
#else
            for (int d = 0; d < head_dim; d++) sum = fma(qv[d], kr[d], sum);
#endif
            score = sum * scale;
            if (softcap > 0.0f) score = tanh(score / softcap) * softcap;
        }
        float best = fmax(m, group_max(score, scratch));
        float e = k < hi ? exp(score - best) : 0.0f;
        p[lid] = e;
        float correction = exp(m - best);  // 0 while m is -inf
        l = l * correction + group_sum(e, scratch);
        for (int j = 0; j < DIMS; j++) acc[j] *= correction;
        int n = min(GROUP, hi - base);
        for (int kk = 0; kk < n; kk++) {
            float pk = p[kk];
            global const float* vr = vc + (base + kk) * stride + kvh * head_dim;
            for (int j = 0; j < DIMS; j++) {
                int d = lid + j * GROUP;
                if (d < head_dim) acc[j] = fma(pk, vr[d], acc[j]);
            }
        }
        m = best;
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    global float* out = part + (((size_t)t * heads + h) * splits + s) * (head_dim + 2);
    if (lid == 0) {
        out[0] = m;
        out[1] = l;
    }
    for (int j = 0; j < DIMS; j++) {
        int d = lid + j * GROUP;
        if (d < head_dim) out[2 + d] = acc[j];
    }
}

kernel void attention_combine(global const float* part, global float* out, int heads, int head_dim,
                              int splits) {
    int th = get_group_id(0), lid = get_local_id(0);
    global const float* pr = part + (size_t)th * splits * (head_dim + 2);
    float best = -INFINITY;
    for (int s = 0; s < splits; s++) best = fmax(best, pr[s * (head_dim + 2)]);
    float total = 0.0f;
    for (int s = 0; s < splits; s++) {
        float m = pr[s * (head_dim + 2)];
        if (m > -INFINITY) total += pr[s * (head_dim + 2) + 1] * exp(m - best);
    }
    for (int d = lid; d < head_dim; d += GROUP) {
        float sum = 0.0f;
        for (int s = 0; s < splits; s++) {
            float m = pr[s * (head_dim + 2)];
            if (m > -INFINITY) sum += pr[s * (head_dim + 2) + 2 + d] * exp(m - best);
        }
        out[(size_t)th * head_dim + d] = sum / total;
    }
}
