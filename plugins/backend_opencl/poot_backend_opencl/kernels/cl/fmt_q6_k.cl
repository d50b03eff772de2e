// super-block of 256: ql[128], qh[64], scales[16] (int8), d (f16); value = d * scale * (6-bit q - 32)
#define BLOCK_VALUES 256
#define BLOCK_BYTES 210
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * (s >> 3);
    int sub = s & 7, n = sub >> 2, k = sub & 3;
    float d = f16_at(b + 208);
    global const uchar* ql = b + 64 * n + 32 * (k & 1);
    global const uchar* qh = b + 128 + 32 * n;
    global const uchar* sc = b + 192 + 8 * n + 2 * k;
    int shift = 4 * (k >> 1);
    for (int l = 0; l < 32; l++) {
        int q = ((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4);
        v[l] = d * (float)(char)sc[l >> 4] * (q - 32);
    }
}
