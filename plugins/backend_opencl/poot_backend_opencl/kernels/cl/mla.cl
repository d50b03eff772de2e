// Multi-head latent attention (DeepSeek V2/V3) over the latent cache [capacity, latent + rope_dim]: a row per
// position holds the RMS-normed latent and the rotated rope key shared by every head. kv_b [heads * (nope +
// v_dim), latent] (the fmt_*.cl included before this file, a dense format: value_at) is absorbed: each head's
// query is taken into the latent space through kv_b's key rows (mla_query), attention_split/combine of
// attention.cl run with one KV head of latent + rope_dim features against that cache (keys and values are the
// same rows), and the attention-weighted latent goes through kv_b's value rows (mla_out).
// ROUND16: 1 (bf16) or 2 (f16) rounds the products' inputs and results to the weight's type, as the reference
// multiplies a 16-bit kv_b in that type (float32 sums inside); 0 keeps float32.

inline float round16(float x) {
#if ROUND16 == 1
    uint u = as_uint(x);
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
    return as_float(u & 0xFFFF0000u);
#elif ROUND16 == 2
    ushort bits;
    vstore_half_rte(x, 0, (half*)&bits);
    return vload_half(0, (const half*)&bits);
#else
    return x;
#endif
}

// The rotation of feature j of a rope_dim-wide rope part x at position p (neox: pairs (i, i + dim/2);
// interleaved: (2i, 2i + 1)), cos and sin scaled by factor.
inline float rotated(global const float* x, int j, int rope_dim, int neox, float p, global const float* inv_freq,
                     float factor) {
    int half_dim = rope_dim / 2;
    int pair = neox ? j % half_dim : j / 2;
    int first = neox ? j < half_dim : j % 2 == 0;
    int ia = neox ? pair : 2 * pair, ib = neox ? pair + half_dim : 2 * pair + 1;
    float a = x[ia], b = x[ib];
    float angle = p * inv_freq[pair];
    float c = cos(angle) * factor, s = sin(angle) * factor;
    return first ? a * c - b * s : b * c + a * s;
}

// One work-group a token: kv[t] = (latent [latent], rope key [rope_dim]) -> the cache row at positions[0] + t,
// the latent RMS-normed by norm_w, the key rotated.
kernel void mla_cache(global const float* kv, global const float* norm_w, global float* cache,
                      global const uint* positions, global const float* inv_freq, int latent, int rope_dim,
                      float eps, int neox, float factor) {
    int t = get_group_id(0), lid = get_local_id(0);
    local float scratch[GROUP];
    int width = latent + rope_dim;
    global const float* x = kv + (size_t)t * width;
    global float* row = cache + (size_t)(positions[0] + t) * width;
    float squares = 0.0f;
    for (int i = lid; i < latent; i += GROUP) squares = fma(x[i], x[i], squares);
    float inv = rsqrt(group_sum(squares, scratch) / latent + eps);
    for (int i = lid; i < latent; i += GROUP) row[i] = x[i] * inv * norm_w[i];
    float p = (float)positions[t];
    for (int j = lid; j < rope_dim; j += GROUP)
        row[latent + j] = rotated(x + latent, j, rope_dim, neox, p, inv_freq, factor);
}

// Work-item (i, h, t): feature i of head h's query of token t in the cache's space, out [tokens, heads, latent +
// rope_dim]: i < latent: sum_d q_nope[d] * kv_b[h * (nope + v_dim) + d, i]; past it, q's rope part rotated.
kernel void mla_query(global const float* q, global const uchar* w, int row_bytes, int w_row0, global float* out,
                      global const uint* positions, global const float* inv_freq, int heads, int nope,
                      int rope_dim, int v_dim, int latent, int neox, float factor) {
    int i = get_global_id(0), h = get_global_id(1), t = get_global_id(2);
    int width = latent + rope_dim;
    if (i >= width) return;
    global const float* qr = q + ((size_t)t * heads + h) * (nope + rope_dim);
    float r;
    if (i < latent) {
        global const uchar* wr = w + ((size_t)w_row0 + (size_t)h * (nope + v_dim)) * row_bytes;
        float sum = 0.0f;
        for (int d = 0; d < nope; d++) sum = fma(round16(qr[d]), value_at(wr + (size_t)d * row_bytes, i), sum);
        r = round16(sum);
    } else {
        r = rotated(qr + nope, i - latent, rope_dim, neox, (float)positions[t], inv_freq, factor);
    }
    out[((size_t)t * heads + h) * width + i] = r;
}

// Work-item (j, h, t): out[t, h, j] = sum_l kv_b[h * (nope + v_dim) + nope + j, l] * o[t, h, l], o the
// attention-weighted cache rows [tokens, heads, latent + rope_dim] (their rope part unused).
kernel void mla_out(global const float* o, global const uchar* w, int row_bytes, int w_row0, global float* out,
                    int heads, int nope, int v_dim, int latent, int width) {
    int j = get_global_id(0), h = get_global_id(1), t = get_global_id(2);
    if (j >= v_dim) return;
    global const uchar* wr = w + ((size_t)w_row0 + (size_t)h * (nope + v_dim) + nope + j) * row_bytes;
    global const float* x = o + ((size_t)t * heads + h) * width;
    float sum = 0.0f;
    for (int l = 0; l < latent; l++) sum = fma(value_at(wr, l), round16(x[l]), sum);
    out[((size_t)t * heads + h) * v_dim + j] = round16(sum);
}

// The expanded form, for a packed kv_b (read by linear.cl): the cache's latent rows are expanded into every
// head's key (nope features) and value each step, then attended as ordinary heads padded with zeros to one head
// size `hd` (>= nope + rope_dim and >= v_dim).

// rows[c, :] = the latent of cache row c, c < capacity (the input of kv_b's product)
kernel void mla_latent_rows(global const float* cache, global float* rows, int latent, int width) {
    int i = get_global_id(0), c = get_global_id(1);
    if (i < latent) rows[(size_t)c * latent + i] = cache[(size_t)c * width + i];
}

// Work-item (i, h, c): keys[c, h, i] = (expanded key nope features, the cache's rope key, zeros) and
// values[c, h, i] = (expanded value, zeros); expanded [capacity, heads * (nope + v_dim)].
kernel void mla_expanded_kv(global const float* expanded, global const float* cache, global float* keys,
                            global float* values, int heads, int nope, int rope_dim, int v_dim, int latent, int hd) {
    int i = get_global_id(0), h = get_global_id(1), c = get_global_id(2);
    if (i >= hd) return;
    global const float* e = expanded + ((size_t)c * heads + h) * (nope + v_dim);
    size_t at = ((size_t)c * heads + h) * hd + i;
    keys[at] = i < nope ? e[i] : i < nope + rope_dim ? cache[(size_t)c * (latent + rope_dim) + latent + i - nope]
                                                     : 0.0f;
    values[at] = i < v_dim ? e[nope + i] : 0.0f;
}

// Work-item (i, h, t): the query [tokens, heads, hd]: q's nope features, its rope part rotated, zeros.
kernel void mla_expanded_query(global const float* q, global float* out, global const uint* positions,
                               global const float* inv_freq, int heads, int nope, int rope_dim, int hd, int neox,
                               float factor) {
    int i = get_global_id(0), h = get_global_id(1), t = get_global_id(2);
    if (i >= hd) return;
    global const float* qr = q + ((size_t)t * heads + h) * (nope + rope_dim);
    float r = i < nope ? qr[i] : 0.0f;
    if (i >= nope && i < nope + rope_dim)
        r = rotated(qr + nope, i - nope, rope_dim, neox, (float)positions[t], inv_freq, factor);
    out[((size_t)t * heads + h) * hd + i] = r;
}

// out[t, h, :] = the first v_dim of o[t, h, :hd]
kernel void mla_narrow(global const float* o, global float* out, int heads, int v_dim, int hd) {
    int j = get_global_id(0), h = get_global_id(1), t = get_global_id(2);
    if (j < v_dim) out[((size_t)t * heads + h) * v_dim + j] = o[((size_t)t * heads + h) * hd + j];
}
