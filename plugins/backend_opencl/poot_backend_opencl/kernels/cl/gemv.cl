// One-token products y[y_off + row] = sum_c W[w_row0 + row, c] * x[c] (+ bias[row]), bandwidth-bound: a
// work-group of GEMV_GROUP work-items takes GEMV_ROWS rows, LANES = GEMV_GROUP / GEMV_ROWS work-items a row. The
// lanes of a row stride over its units (8 values of a dense row, one 16-byte load; a 32-value piece of a GGUF
// row, so neighbouring lanes read neighbouring blocks), then the row's partial sums are reduced in local memory.
// Dense rows must be 16-byte aligned (row_bytes % 16 == 0: the host picks cl/linear.cl otherwise).
// No early return anywhere: every work-item reaches the barriers (pocl needs it).
#define LANES (GEMV_GROUP / GEMV_ROWS)

// This lane's share of row `wr` times x.
inline float row_part(global const uchar* wr, global const float* x, int cols, int lane) {
    float acc = 0.0f;
#if BLOCK_VALUES == 1
    int units = cols / 8;
    for (int u = lane; u < units; u += LANES) {
        float v[8];
        decode8(wr, u, v);
        float4 xa = ((global const float4*)x)[2 * u], xb = ((global const float4*)x)[2 * u + 1];
        acc = fma(v[0], xa.x, acc); acc = fma(v[1], xa.y, acc); acc = fma(v[2], xa.z, acc);
        acc = fma(v[3], xa.w, acc); acc = fma(v[4], xb.x, acc); acc = fma(v[5], xb.y, acc);
        acc = fma(v[6], xb.z, acc); acc = fma(v[7], xb.w, acc);
    }
    for (int i = 8 * units + lane; i < cols; i += LANES) acc = fma(value_at(wr, i), x[i], acc);
#else
    int subs = cols / 32;
    for (int s = lane; s < subs; s += LANES) {
        float v[32];
        decode_sub(wr, s, v);
        global const float4* xs = (global const float4*)(x + 32 * s);
        float dot = 0.0f;
        for (int i = 0; i < 8; i++) {
            float4 xv = xs[i];
            dot = fma(v[4 * i], xv.x, dot); dot = fma(v[4 * i + 1], xv.y, dot);
            dot = fma(v[4 * i + 2], xv.z, dot); dot = fma(v[4 * i + 3], xv.w, dot);
        }
        acc += dot;
    }
#endif
    return acc;
}

// The sum of `acc` over the LANES lanes of each row, valid at lane 0.
inline float rows_sum(float acc, local float* part) {
    int lid = get_local_id(0), lane = lid % LANES;
    part[lid] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = LANES / 2; half_size > 0; half_size >>= 1) {
        if (lane < half_size) part[lid] += part[lid + half_size];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return part[lid];
}

// gate_col >= 0: an expert's product; an unchosen expert (gate[gate_col] == 0) gives 0 and reads nothing.
kernel void gemv(global const uchar* w, int row_bytes, int w_row0, global const float* x, int cols, int rows,
                 global float* y, int y_off, global const float* bias, int has_bias, global const float* gate,
                 int gate_col) {
    local float part[GEMV_GROUP];
    int lid = get_local_id(0), lane = lid % LANES;
    int row = get_group_id(0) * GEMV_ROWS + lid / LANES;
    int chosen = gate_col < 0 || gate[gate_col] != 0.0f;
    float acc = row < rows && chosen ? row_part(w + (size_t)(w_row0 + row) * row_bytes, x, cols, lane) : 0.0f;
    float total = rows_sum(acc, part);
    if (lane == 0 && row < rows) y[y_off + row] = chosen ? total + (has_bias ? bias[row] : 0.0f) : 0.0f;
}

// Up to three products of one x in one launch (q, k and v; gate and up), each matrix in its own buffer and
// output: work-groups 0..groups0-1 take matrix 0, the next groups1 matrix 1, the rest matrix 2. Bias bit i of
// has_bias says matrix i has one.
kernel void gemv3(global const uchar* w0, global const uchar* w1, global const uchar* w2, int row_bytes,
                  int row0_0, int row0_1, int row0_2, global const float* x, int cols, int rows0, int rows1,
                  int rows2, global float* y0, global float* y1, global float* y2, global const float* b0,
                  global const float* b1, global const float* b2, int has_bias) {
    local float part[GEMV_GROUP];
    int lid = get_local_id(0), lane = lid % LANES;
    int g = get_group_id(0);
    int groups0 = (rows0 + GEMV_ROWS - 1) / GEMV_ROWS, groups1 = (rows1 + GEMV_ROWS - 1) / GEMV_ROWS;
    int m = g < groups0 ? 0 : g < groups0 + groups1 ? 1 : 2;
    global const uchar* w = m == 0 ? w0 : m == 1 ? w1 : w2;
    global float* y = m == 0 ? y0 : m == 1 ? y1 : y2;
    global const float* b = m == 0 ? b0 : m == 1 ? b1 : b2;
    int rows = m == 0 ? rows0 : m == 1 ? rows1 : rows2;
    int row0 = m == 0 ? row0_0 : m == 1 ? row0_1 : row0_2;
    int first = m == 0 ? 0 : m == 1 ? groups0 : groups0 + groups1;
    int row = (g - first) * GEMV_ROWS + lid / LANES;
    float acc = row < rows ? row_part(w + (size_t)(row0 + row) * row_bytes, x, cols, lane) : 0.0f;
    float total = rows_sum(acc, part);
    if (lane == 0 && row < rows) y[row] = total + (((has_bias >> m) & 1) ? b[row] : 0.0f);
}

// The products of a gate and an up matrix of one x with the gated activation as they are written (activate.cl):
// a work-group takes GEMV_ROWS / 2 rows of each (its first half of row slots gate's, the second up's, so the
// two sums of an output meet in local memory) and writes y[row] = act(gate_row . x) * (up_row . x).
// GEMV_ROWS >= 2. gate_col >= 0: an expert's products, as in gemv (an unchosen expert gives 0, reads nothing).
kernel void gemv_gated(global const uchar* wg, global const uchar* wu, int row_bytes, int row0_g, int row0_u,
                       global const float* x, int cols, int rows, global float* y, int act,
                       global const float* gate, int gate_col) {
    local float part[GEMV_GROUP];
    int lid = get_local_id(0), lane = lid % LANES, slot = lid / LANES;
    int half_rows = GEMV_ROWS / 2, m = slot / half_rows;
    int row = get_group_id(0) * half_rows + slot % half_rows;
    int chosen = gate_col < 0 || gate[gate_col] != 0.0f;
    global const uchar* w = m == 0 ? wg + (size_t)(row0_g + row) * row_bytes : wu + (size_t)(row0_u + row) * row_bytes;
    float acc = row < rows && chosen ? row_part(w, x, cols, lane) : 0.0f;
    float total = rows_sum(acc, part);  // every row's sum stays at its lane 0 in part
    if (lane == 0 && m == 0 && row < rows)
        y[row] = chosen ? activate(total, act) * part[(slot + half_rows) * LANES] : 0.0f;
}
