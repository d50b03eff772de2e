// block: d (f16), qh (32 fifth bits), qs[16]; value = (nibble | fifth bit << 4) - 16, times d
#define BLOCK_VALUES 32
#define BLOCK_BYTES 22
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * s;
    float d = f16_at(b);
    uint qh = u32_at(b + 2);
    for (int j = 0; j < 16; j++) {
        int lo = (b[6 + j] & 0xF) | (((qh >> j) & 1) << 4);
        int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        v[j] = (lo - 16) * d;
        v[j + 16] = (hi - 16) * d;
    }
}
