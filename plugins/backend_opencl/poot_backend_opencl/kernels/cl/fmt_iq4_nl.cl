// block: d (f16), qs[16]; value = IQ4_VALUES[nibble] * d, low nibbles first
#define BLOCK_VALUES 32
#define BLOCK_BYTES 18
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * s;
    float d = f16_at(b);
    for (int j = 0; j < 16; j++) {
        v[j] = IQ4_VALUES[b[2 + j] & 0xF] * d;
        v[j + 16] = IQ4_VALUES[b[2 + j] >> 4] * d;
    }
}
