#define BLOCK_VALUES 1
#define BLOCK_BYTES 2
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const ushort* p = (global const ushort*)row + 32 * s;
    for (int i = 0; i < 32; i++) v[i] = bf16_bits(p[i]);
}
inline float value_at(global const uchar* row, int i) { return bf16_bits(((global const ushort*)row)[i]); }
// eight values from one 16-byte load (the row 16-byte aligned: the host checks before it picks cl/gemv.cl)
inline void decode8(global const uchar* row, int u, float* v) {
    uint4 q = ((global const uint4*)row)[u];
    uint w[4] = {q.x, q.y, q.z, q.w};
    for (int i = 0; i < 4; i++) {
        v[2 * i] = as_float(w[i] << 16);
        v[2 * i + 1] = as_float(w[i] & 0xFFFF0000u);
    }
}
