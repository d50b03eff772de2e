// Shared helpers. GROUP (the work-group size of every reduction kernel, a power of two) is defined by the host.

inline float f16_at(global const uchar* p) { return vload_half(0, (global const half*)p); }

inline float bf16_bits(ushort bits) { return as_float(((uint)bits) << 16); }

inline uint u32_at(global const uchar* p) {  // unaligned little-endian load
    return (uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24);
}

// The sum of `value` over the work-group; every work-item gets it. `scratch` holds GROUP floats.
inline float group_sum(float value, local float* scratch) {
    int lid = get_local_id(0);
    scratch[lid] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = GROUP / 2; half_size > 0; half_size >>= 1) {
        if (lid < half_size) scratch[lid] += scratch[lid + half_size];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

inline float group_max(float value, local float* scratch) {
    int lid = get_local_id(0);
    scratch[lid] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = GROUP / 2; half_size > 0; half_size >>= 1) {
        if (lid < half_size) scratch[lid] = fmax(scratch[lid], scratch[lid + half_size]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}
