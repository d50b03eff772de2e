// Dense f32 rows: unit u of row `row` is elements 32u .. 32u+31.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    for (var i = 0u; i < 32u; i++) {
        let k = u * 32u + i;
        (*vals)[i] = select(0.0, bitcast<f32>(wt[min(row * p.cols + k, arrayLength(&wt) - 1u)]), k < p.cols);
    }
}
