#define BLOCK_VALUES 1
#define BLOCK_BYTES 4
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const float* p = (global const float*)row + 32 * s;
    for (int i = 0; i < 32; i++) v[i] = p[i];
}
inline float value_at(global const uchar* row, int i) { return ((global const float*)row)[i]; }
// eight values from two 16-byte loads
inline void decode8(global const uchar* row, int u, float* v) {
    float4 a = ((global const float4*)row)[2 * u], b = ((global const float4*)row)[2 * u + 1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
