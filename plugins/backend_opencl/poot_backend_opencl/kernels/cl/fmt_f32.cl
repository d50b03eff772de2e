#define BLOCK_VALUES 1
#define BLOCK_BYTES 4
inline void decode_sub(global const uchar* row, int s, float* v) {
    global const float* p = (global const float*)row + 32 * s;
    for (int i = 0; i < 32; i++) v[i] = p[i];
}
inline float value_at(global const uchar* row, int i) { return ((global const float*)row)[i]; }
