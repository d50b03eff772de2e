// y[t, y_off + row] = sum_c W[w_row0 + row, c] * x[t, c] (+ bias[row]), W in the stored format of the fmt_*.cl
// included before this file. One work-group per (row, tile of TILE tokens): its work-items take the row's
// 32-value pieces in turn (a dense row's tail after them), decode each once and use it for every token of the tile; then one tree sum per token.
// gate_col >= 0 (a mixture-of-experts expert): tokens whose weight gate[t, gate_col] is 0 give 0, and a tile
// where all of them are 0 reads nothing of W (a decode step reads only the chosen experts).
#define TILE 8

kernel void linear(global const uchar* w, int row_bytes, int w_row0, global const float* x, int x_off, int cols,
                   int tokens, global float* y, int y_off, int y_stride, global const float* bias, int has_bias,
                   global const float* gate, int gate_stride, int gate_col) {
    int row = get_group_id(0), lid = get_local_id(0);
    int t0 = get_group_id(1) * TILE;
    int nt = min(TILE, tokens - t0);
    local float part[GROUP * TILE];
    if (gate_col >= 0) {
        int chosen = 0;
        for (int t = 0; t < nt; t++) chosen |= gate[(t0 + t) * gate_stride + gate_col] != 0.0f;
        if (!chosen) {
            if (lid < nt) y[y_off + (t0 + lid) * y_stride + row] = 0.0f;
            return;
        }
    }
    float acc[TILE];
    for (int t = 0; t < TILE; t++) acc[t] = 0.0f;
    global const uchar* wr = w + (size_t)(w_row0 + row) * row_bytes;
    global const float* xt = x + x_off + (size_t)t0 * cols;
    int subs = cols / 32;
    for (int s = lid; s < subs; s += GROUP) {
        float v[32];
        decode_sub(wr, s, v);
        for (int t = 0; t < nt; t++) {
            global const float* xs = xt + (size_t)t * cols + 32 * s;
            float dot = 0.0f;
            for (int i = 0; i < 32; i++) dot = fma(v[i], xs[i], dot);
            acc[t] += dot;
        }
    }
#if BLOCK_VALUES == 1
    for (int i = 32 * subs + lid; i < cols; i += GROUP) {  // a dense row's tail past its last whole piece
        float v = value_at(wr, i);
        for (int t = 0; t < nt; t++) acc[t] = fma(v, xt[(size_t)t * cols + i], acc[t]);
    }
#endif
    for (int t = 0; t < TILE; t++) part[t * GROUP + lid] = acc[t];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = GROUP / 2; half_size > 0; half_size >>= 1) {
        if (lid < half_size)
            for (int t = 0; t < nt; t++) part[t * GROUP + lid] += part[t * GROUP + lid + half_size];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid < nt) {
        float out = part[lid * GROUP];
        if (has_bias) out += bias[row];
        if (gate_col >= 0 && gate[(t0 + lid) * gate_stride + gate_col] == 0.0f) out = 0.0f;
        y[y_off + (t0 + lid) * y_stride + row] = out;
    }
}

// out[t, :] = W[ids[t], :] * scale: rows of the table decoded as stored (an id past the table gives zeros).
kernel void embed(global const uchar* w, int row_bytes, int rows, int cols, global const uint* ids,
                  global float* out, float scale) {
    int t = get_group_id(0), lid = get_local_id(0);
    uint id = ids[t];
    global float* o = out + (size_t)t * cols;
    for (int s = lid; s < cols / 32; s += GROUP) {
        float v[32];
        if (id < (uint)rows) {
            decode_sub(w + (size_t)id * row_bytes, s, v);
        } else {
            for (int i = 0; i < 32; i++) v[i] = 0.0f;
        }
        for (int i = 0; i < 32; i++) o[32 * s + i] = v[i] * scale;
    }
#if BLOCK_VALUES == 1
    for (int i = cols / 32 * 32 + lid; i < cols; i += GROUP)
        o[i] = id < (uint)rows ? value_at(w + (size_t)id * row_bytes, i) * scale : 0.0f;
#endif
}
