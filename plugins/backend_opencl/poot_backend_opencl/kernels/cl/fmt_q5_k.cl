// super-block of 256: d, dmin (f16), scales[12], qh[32] (fifth bits), qs[128]
#define BLOCK_VALUES 256
#define BLOCK_BYTES 176
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * (s >> 3);
    int sub = s & 7;
    float d = f16_at(b), dmin = f16_at(b + 2), sc, mn;
    k4_scale_min(b + 4, sub, &sc, &mn);
    float dl = d * sc, ml = dmin * mn;
    global const uchar* qh = b + 16;
    global const uchar* q = b + 48 + 32 * (sub >> 1);
    int shift = 4 * (sub & 1);
    uchar bit = (uchar)(1 << sub);
    for (int l = 0; l < 32; l++) v[l] = dl * (((q[l] >> shift) & 0xF) + ((qh[l] & bit) ? 16 : 0)) - ml;
}
