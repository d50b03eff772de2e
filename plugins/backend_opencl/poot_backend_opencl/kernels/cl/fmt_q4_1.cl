// block: d, m (f16), qs[16]; value = nibble * d + m
#define BLOCK_VALUES 32
#define BLOCK_BYTES 20
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * s;
    float d = f16_at(b), m = f16_at(b + 2);
    for (int j = 0; j < 16; j++) {
        v[j] = (b[4 + j] & 0xF) * d + m;
        v[j + 16] = (b[4 + j] >> 4) * d + m;
    }
}
