// Dense bf16 rows as u32 pairs: a bf16 is the top half of an f32.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    for (var i = 0u; i < 32u; i++) {
        let k = u * 32u + i;
        let e = row * p.cols + min(k, p.cols - 1u);
        let bits = (wt[e >> 1u] >> ((e & 1u) * 16u)) & 0xffffu;
        (*vals)[i] = select(0.0, bitcast<f32>(bits << 16u), k < p.cols);
    }
}
