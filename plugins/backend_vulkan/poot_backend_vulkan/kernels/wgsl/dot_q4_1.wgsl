// Q4_1 unit_dot: 20-byte blocks (f16 d, f16 m, 16 bytes of nibbles as Q4_0's); value = d * q + m.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 32u) + u) * 20u;
    let dm = unpack2x16float(wt[base >> 2u]);
    var acc = 0.0;
    var xs = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        let w = wt[(base >> 2u) + 1u + j];
        let lo = x[u * 8u + j];
        let hi = x[u * 8u + 4u + j];
        acc += dot(nibbles(w, 0u, 15u), lo) + dot(nibbles(w, 4u, 15u), hi);
        xs += lo + hi;
    }
    return dm.x * acc + dm.y * (xs.x + xs.y + xs.z + xs.w);
}
