#define BLOCK_VALUES 1
#define BLOCK_BYTES 2
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const half* p = (global const half*)row + 32 * s;
    for (int i = 0; i < 32; i++) v[i] = vload_half(i, p);
}
inline float value_at(global const uchar* row, int i) { return vload_half(i, (global const half*)row); }
// eight values from one 16-byte row piece (vload_half: no cl_khr_fp16 needed)
inline void decode8(global const uchar* row, int u, float* v) {
    float8 f = vload_half8(u, (global const half*)row);
    v[0] = f.s0; v[1] = f.s1; v[2] = f.s2; v[3] = f.s3; v[4] = f.s4; v[5] = f.s5; v[6] = f.s6; v[7] = f.s7;
}
