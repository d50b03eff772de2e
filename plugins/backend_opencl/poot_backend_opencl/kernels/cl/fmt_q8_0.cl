// block: d (f16), qs[32] (int8); value = q * d
#define BLOCK_VALUES 32
#define BLOCK_BYTES 34
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * s;
    float d = f16_at(b);
    for (int j = 0; j < 32; j++) v[j] = (float)(char)b[2 + j] * d;
}
