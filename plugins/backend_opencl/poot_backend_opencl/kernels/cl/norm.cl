// RMSNorm of each token's row, with the residual add before it when has_res: sum = x + res is stored to
// sum_out (for the sum's other readers) and normalized. out = v / sqrt(mean(v^2) + eps) * (w + offset).
// One work-group a row. NORM_VALS > 0 (the host's choice when width <= NORM_VALS * GROUP): each work-item
// keeps its NORM_VALS values of the row (and of w) in registers, so every load is issued before the sum
// and the row is read once; NORM_VALS == 0 loops over the row twice.
kernel void rms_norm(global const float* x, global const float* res, int has_res, global float* sum_out,
                     global const float* w, global float* out, int width, float eps, float offset) {
    int t = get_group_id(0), lid = get_local_id(0);
    local float scratch[GROUP];
    global const float* xr = x + (size_t)t * width;
    global const float* rr = res + (size_t)t * width;
    float squares = 0.0f;
#if NORM_VALS > 0
    float v[NORM_VALS], g[NORM_VALS];
    for (int j = 0; j < NORM_VALS; j++) {
        int i = lid + j * GROUP;
        v[j] = i < width ? xr[i] : 0.0f;
        g[j] = i < width ? w[i] + offset : 0.0f;
        if (has_res && i < width) v[j] += rr[i];
    }
    for (int j = 0; j < NORM_VALS; j++) {
        int i = lid + j * GROUP;
        if (has_res && i < width) sum_out[(size_t)t * width + i] = v[j];
        squares = fma(v[j], v[j], squares);
    }
    float inv = rsqrt(group_sum(squares, scratch) / width + eps);
    for (int j = 0; j < NORM_VALS; j++) {
        int i = lid + j * GROUP;
        if (i < width) out[(size_t)t * width + i] = v[j] * inv * g[j];
    }
#else
    for (int i = lid; i < width; i += GROUP) {
        float v = xr[i];
        if (has_res) {
            v += rr[i];
            sum_out[(size_t)t * width + i] = v;
        }
        squares = fma(v, v, squares);
    }
    float inv = rsqrt(group_sum(squares, scratch) / width + eps);
    for (int i = lid; i < width; i += GROUP) {
        float v = has_res ? xr[i] + rr[i] : xr[i];
        out[(size_t)t * width + i] = v * inv * (w[i] + offset);
    }
#endif
}
