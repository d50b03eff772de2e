#define BLOCK_VALUES 1
#define BLOCK_BYTES 2
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const half* p = (global const half*)row + 32 * s;
    for (int i = 0; i < 32; i++) v[i] = vload_half(i, p);
}
inline float value_at(global const uchar* row, int i) { return vload_half(i, (global const half*)row); }
