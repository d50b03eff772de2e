// super-block of 256: hmask[32] (high bits), qs[64] (low 2 bits), scales[12] (16 six-bit scales), d (f16)
#define BLOCK_VALUES 256
#define BLOCK_BYTES 110
inline int q3_scale(global const uchar* sc, int k) {
    int low = k < 8 ? (sc[k] & 0xF) : (sc[k - 8] >> 4);
    int high = (sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
    return (low | (high << 4)) - 32;
}
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * (s >> 3);
    int sub = s & 7, n = sub >> 2, shift = 2 * (sub & 3);
    uchar m = (uchar)(1 << sub);
    float d = f16_at(b + 108);
    global const uchar* hm = b;
    global const uchar* q = b + 32 + 32 * n;
    for (int h = 0; h < 2; h++) {
        float dl = d * q3_scale(b + 96, 2 * sub + h);
        for (int l = 0; l < 16; l++) {
            int i = 16 * h + l;
            v[i] = dl * ((int)((q[i] >> shift) & 3) - ((hm[i] & m) ? 0 : 4));
        }
    }
}
