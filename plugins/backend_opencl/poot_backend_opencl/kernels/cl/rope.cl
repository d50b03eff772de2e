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
