// super-block of 256: d (f16), scales_h (u16), scales_l[4], qs[128]; 6-bit scale per 32 values, minus 32
#define BLOCK_VALUES 256
#define BLOCK_BYTES 136
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * (s >> 3);
    int ib = s & 7;
    float d = f16_at(b);
    uint scales_h = (uint)b[2] | ((uint)b[3] << 8);
    int ls = ((b[4 + ib / 2] >> (4 * (ib & 1))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4);
    float dl = d * (ls - 32);
    global const uchar* qs = b + 8 + 16 * ib;
    for (int j = 0; j < 16; j++) {
        v[j] = dl * IQ4_VALUES[qs[j] & 0xF];
        v[j + 16] = dl * IQ4_VALUES[qs[j] >> 4];
    }
}
