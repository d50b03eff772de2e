// Merges split-K partial attention: out[t, head, :] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
struct Params {
    heads: u32,
    head_dim: u32,
    splits: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> partial: array<f32>;
@group(0) @binding(2) var<storage, read> stats: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let th = wid.y * p.heads + wid.x;  // token * heads + head
    let first = th * p.splits;
    var big = -3.0e38;
    for (var s = 0u; s < p.splits; s++) {
        big = max(big, stats[(first + s) * 2u]);
    }
    var total = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        total += exp(stats[(first + s) * 2u] - big) * stats[(first + s) * 2u + 1u];
    }
    for (var i = lid; i < p.head_dim; i += 64u) {
        var sum = 0.0;
        for (var s = 0u; s < p.splits; s++) {
            sum += exp(stats[(first + s) * 2u] - big) * partial[(first + s) * p.head_dim + i];
        }
        out[th * p.head_dim + i] = select(0.0, sum / total, total > 0.0);
    }
}
