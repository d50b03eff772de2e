// Dense rows for gemv.wgsl: 16-byte words, PER_WORD values each (gemv_<fmt>.wgsl's word_dot). Thread `lane`
// reads words lane, lane+LANES, ... so each step of a row's threads is contiguous; four words are loaded before
// any is used (independent loads in flight).
@group(0) @binding(1) var<storage, read> wt: array<vec4<u32>>;

fn row_sum(row: u32, first: u32, end: u32) -> f32 {
    let base = row * (p.cols / PER_WORD);
    var acc = 0.0;
    var i = first;
    for (; i + 3u * LANES < end; i += 4u * LANES) {
        let w0 = wt[base + i];
        let w1 = wt[base + i + LANES];
        let w2 = wt[base + i + 2u * LANES];
        let w3 = wt[base + i + 3u * LANES];
        acc += word_dot(w0, i) + word_dot(w1, i + LANES);
        acc += word_dot(w2, i + 2u * LANES) + word_dot(w3, i + 3u * LANES);
    }
    for (; i < end; i += LANES) {
        acc += word_dot(wt[base + i], i);
    }
    return acc;
}
