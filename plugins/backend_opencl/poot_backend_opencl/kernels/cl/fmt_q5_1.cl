// block: d, m (f16), qh (32 fifth bits), qs[16]; value = (nibble | fifth bit << 4) * d + m
#define BLOCK_VALUES 32
#define BLOCK_BYTES 24
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * s;
    float d = f16_at(b), m = f16_at(b + 2);
    uint qh = u32_at(b + 4);
    for (int j = 0; j < 16; j++) {
        int lo = (b[8 + j] & 0xF) | (((qh >> j) & 1) << 4);
        int hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        v[j] = lo * d + m;
        v[j + 16] = hi * d + m;
    }
}
