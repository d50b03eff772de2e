// super-block of 256: scales[16] (4-bit scale, 4-bit min), qs[64] (2-bit), d, dmin (f16)
#define BLOCK_VALUES 256
#define BLOCK_BYTES 84
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * (s >> 3);
    int sub = s & 7, n = sub >> 2, shift = 2 * (sub & 3);
    float d = f16_at(b + 80), dmin = f16_at(b + 82);
    global const uchar* q = b + 16 + 32 * n;
    for (int h = 0; h < 2; h++) {
        uchar sc = b[2 * sub + h];
        float dl = d * (sc & 0xF), ml = dmin * (sc >> 4);
        for (int l = 0; l < 16; l++) v[16 * h + l] = dl * ((q[16 * h + l] >> shift) & 3) - ml;
    }
}
