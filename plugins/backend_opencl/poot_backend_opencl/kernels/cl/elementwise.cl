// Element-wise ops over n floats (activate.cl is compiled in before this file).

kernel void gated(global const float* gate, global const float* up, global float* out, int n, int act) {
    int i = get_global_id(0);
    if (i < n) out[i] = activate(gate[i], act) * up[i];
}

kernel void activation(global const float* x, global float* out, int n, int act) {
    int i = get_global_id(0);
    if (i < n) out[i] = activate(x[i], act);
}

kernel void add(global const float* a, global const float* b, global float* out, int n) {
    int i = get_global_id(0);
    if (i < n) out[i] = a[i] + b[i];
}

kernel void mul(global const float* a, global const float* b, global float* out, int n) {
    int i = get_global_id(0);
    if (i < n) out[i] = a[i] * b[i];
}

kernel void scale(global const float* x, global float* out, int n, float factor) {
    int i = get_global_id(0);
    if (i < n) out[i] = x[i] * factor;
}

kernel void softcap(global const float* x, global float* out, int n, float cap) {
    int i = get_global_id(0);
    if (i < n) out[i] = tanh(x[i] / cap) * cap;
}

kernel void copy(global const float* src, int src_off, global float* dst, int n) {
    int i = get_global_id(0);
    if (i < n) dst[i] = src[src_off + i];
}

// ids[r] = the index of the largest of row r's n values (the lowest index on ties, as numpy's argmax)
kernel void argmax(global const float* x, global uint* ids, int n) {
    int r = get_group_id(0), lid = get_local_id(0);
    local float best[GROUP];
    local int where[GROUP];
    global const float* xr = x + (size_t)r * n;
    float b = -INFINITY;
    int at = n;
    int i = lid;
    for (; i + 7 * GROUP < n; i += 8 * GROUP) {  // eight loads in flight before they are compared
        float a[8];
        for (int j = 0; j < 8; j++) a[j] = xr[i + j * GROUP];
        for (int j = 0; j < 8; j++) {
            if (at == n || a[j] > b) {  // increasing index: a tie keeps the lower one
                b = a[j];
                at = i + j * GROUP;
            }
        }
    }
    for (; i < n; i += GROUP) {
        if (at == n || xr[i] > b) {
            b = xr[i];
            at = i;
        }
    }
    best[lid] = b;
    where[lid] = at;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = GROUP / 2; half_size > 0; half_size >>= 1) {
        if (lid < half_size) {
            float ob = best[lid + half_size];
            int oa = where[lid + half_size];
            if (oa < n && (where[lid] == n || ob > best[lid] || (ob == best[lid] && oa < where[lid]))) {
                best[lid] = ob;
                where[lid] = oa;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) ids[r] = (uint)where[0];
}
