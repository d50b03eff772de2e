#define BLOCK_VALUES 1
#define BLOCK_BYTES 2
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const ushort* p = (global const ushort*)row + 32 * s;
    for (int i = 0; i < 32; i++) v[i] = bf16_bits(p[i]);
}
inline float value_at(global const uchar* row, int i) { return bf16_bits(((global const ushort*)row)[i]); }
