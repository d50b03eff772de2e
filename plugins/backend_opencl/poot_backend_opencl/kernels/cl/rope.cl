// Rotary embedding of x [tokens, heads, head_dim] into out (may be x itself): the first `dim` features of each
// head rotate by position * inv_freq[i] (neox: pairs (i, i + dim/2); interleaved: (2i, 2i + 1)), cos and sin
// scaled by `factor` (YaRN). With has_cache, the rotated rows are also written to the KV cache
// [capacity, heads, head_dim] at positions[0] + t (the key's rope and its cache write in one kernel).
kernel void rope(global const float* x, global float* out, global const uint* positions,
                 global const float* inv_freq, int heads, int head_dim, int dim, int neox, float factor,
                 global float* cache, int has_cache) {
    int t = get_global_id(1), h = get_global_id(0);
    if (h >= heads) return;
    size_t base = ((size_t)t * heads + h) * head_dim;
    float p = (float)positions[t];
    int half_dim = dim / 2;
    for (int i = dim; i < head_dim; i++) out[base + i] = x[base + i];
    for (int i = 0; i < half_dim; i++) {  // each pair is read before it is written: out may be x
        int ia = neox ? i : 2 * i, ib = neox ? i + half_dim : 2 * i + 1;
        float a = x[base + ia], b = x[base + ib];
        float angle = p * inv_freq[i];
        float c = cos(angle) * factor, s = sin(angle) * factor;
        out[base + ia] = a * c - b * s;
        out[base + ib] = b * c + a * s;
    }
    if (has_cache) {
        size_t at = ((size_t)(positions[0] + t) * heads + h) * head_dim;
        for (int i = 0; i < head_dim; i++) cache[at + i] = out[base + i];
    }
}

// cache[positions[0] + t, :] = src[t, :] (rows of `width` floats)
kernel void kv_write(global const float* src, global float* cache, global const uint* positions, int width) {
    int i = get_global_id(0), t = get_global_id(1);
    if (i < width) cache[(size_t)(positions[0] + t) * width + i] = src[(size_t)t * width + i];
}

// The q and k ropes of an attention and its cache writes in one launch: work-item (i, h, t) takes two features
// of head h of token t (i < dim / 2: a rotated pair; past it, two of the features beyond dim, copied). Heads
// 0..q_heads-1 are q's (into q_out), the next kv_heads k's (into k_out and the k cache), the last kv_heads v's
// (into the v cache). Rotation as in rope above; cache rows at positions[0] + t. head_dim is even.
kernel void rope_qkv(global const float* q, global float* q_out, global const float* k, global float* k_out,
                     global const float* v, global float* k_cache, global float* v_cache,
                     global const uint* positions, global const float* inv_freq, int q_heads, int kv_heads,
                     int head_dim, int dim, int neox, float factor) {
    int i = get_global_id(0), h = get_global_id(1), t = get_global_id(2);
    if (i >= head_dim / 2) return;
    int kind = h < q_heads ? 0 : h < q_heads + kv_heads ? 1 : 2;
    int hh = kind == 0 ? h : kind == 1 ? h - q_heads : h - q_heads - kv_heads;
    size_t base = ((size_t)t * (kind == 0 ? q_heads : kv_heads) + hh) * head_dim;
    size_t at = ((size_t)(positions[0] + t) * kv_heads + hh) * head_dim;
    int half_dim = dim / 2;
    int ia = i < half_dim ? (neox ? i : 2 * i) : dim + 2 * (i - half_dim);
    int ib = i < half_dim ? (neox ? i + half_dim : 2 * i + 1) : ia + 1;
    if (kind == 2) {
        v_cache[at + ia] = v[base + ia];
        v_cache[at + ib] = v[base + ib];
        return;
    }
    global const float* x = kind == 0 ? q : k;
    float a = x[base + ia], b = x[base + ib];
    if (i < half_dim) {
        float angle = (float)positions[t] * inv_freq[i];
        float c = cos(angle) * factor, s = sin(angle) * factor;
        float ra = a * c - b * s;
        b = b * c + a * s;
        a = ra;
    }
    global float* out = kind == 0 ? q_out : k_out;
    out[base + ia] = a;
    out[base + ib] = b;
    if (kind == 1) {
        k_cache[at + ia] = a;
        k_cache[at + ib] = b;
    }
}
