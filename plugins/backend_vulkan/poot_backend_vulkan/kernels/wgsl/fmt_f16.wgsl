// Dense f16 rows as u32 pairs, widened with unpack2x16float (no shader-f16 needed).
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    for (var i = 0u; i < 32u; i++) {
        let k = u * 32u + i;
        let e = row * p.cols + min(k, p.cols - 1u);
        let pair = unpack2x16float(wt[e >> 1u]);
        (*vals)[i] = select(0.0, select(pair.x, pair.y, (e & 1u) == 1u), k < p.cols);
    }
}
