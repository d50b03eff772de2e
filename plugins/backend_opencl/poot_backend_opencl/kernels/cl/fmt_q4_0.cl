// block: d (f16), qs[16]; value j = (nibble - 8) * d, low nibbles first
#define BLOCK_VALUES 32
#define BLOCK_BYTES 18
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const uchar* b = row + BLOCK_BYTES * s;
    float d = f16_at(b);
    for (int j = 0; j < 16; j++) {
        v[j] = ((int)(b[2 + j] & 0xF) - 8) * d;
        v[j + 16] = ((int)(b[2 + j] >> 4) - 8) * d;
    }
}
