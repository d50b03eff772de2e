// super-block of 256: d, dmin (f16), scales[12], qs[128]; value = d * sc * nibble - dmin * m
#define BLOCK_VALUES 256
#define BLOCK_BYTES 144
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * (s >> 3);
    int sub = s & 7;
    float d = f16_at(b), dmin = f16_at(b + 2), sc, mn;
    k4_scale_min(b + 4, sub, &sc, &mn);
    float dl = d * sc, ml = dmin * mn;
    // the 32 bytes as 8 aligned 32-bit loads (blocks of 144 bytes keep qs 4-byte aligned), little-endian
    global const uint* q = (global const uint*)(b + 16 + 32 * (sub >> 1));
    int shift = 4 * (sub & 1);
    for (int k = 0; k < 8; k++) {
        uint word = q[k] >> shift;
        for (int j = 0; j < 4; j++) v[4 * k + j] = dl * ((word >> (8 * j)) & 0xF) - ml;
    }
}
