// GGUF rows for gemv.wgsl: a row's 32-value units (a block, or one sub-block of a 256-value super-block), thread
// `lane` taking units lane, lane+LANES, ... so the threads of a row read neighbouring blocks at each step.
// unit_dot(row, u) = sum over the unit's 32 values of W * x comes from the layout's dot_<fmt>.wgsl (u32 words).
@group(0) @binding(1) var<storage, read> wt: array<u32>;

const PER_WORD: u32 = 32u;

fn row_sum(row: u32, first: u32, end: u32) -> f32 {
    var acc = 0.0;
    var u = first;
    for (; u + LANES < end; u += 2u * LANES) {
        acc += unit_dot(row, u) + unit_dot(row, u + LANES);
    }
    if (u < end) {
        acc += unit_dot(row, u);
    }
    return acc;
}

// The u32 at byte offset b (any alignment): GGUF blocks of 18, 22, 34 or 210 bytes put words off 4-byte bounds.
fn word_at(b: u32) -> u32 {
    let i = b >> 2u;
    let s = (b & 3u) * 8u;
    if (s == 0u) {
        return wt[i];
    }
    return (wt[i] >> s) | (wt[i + 1u] << (32u - s));
}

// The four bytes of w as values, (w >> shift) & mask per byte.
fn nibbles(w: u32, shift: u32, mask: u32) -> vec4<f32> {
    let v = (vec4<u32>(w) >> vec4<u32>(shift, shift + 8u, shift + 16u, shift + 24u)) & vec4<u32>(mask);
    return vec4<f32>(v);
}

// The four bytes of w as signed 8-bit values.
fn signed_bytes(w: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(w) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}
