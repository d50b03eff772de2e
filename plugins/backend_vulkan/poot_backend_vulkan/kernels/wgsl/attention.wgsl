// Causal attention with GQA over a contiguous KV cache [capacity, kv_heads, head_dim], online softmax.
// Query t (q[tokens, heads, head_dim]) sits at absolute position start + t and sees keys
// max(0, pos + 1 - window) .. pos (window 0 = unlimited). Scores are scaled, then soft-capped when
// softcap > 0. One workgroup per (head, token, split): with splits == 1 it writes the normalised
// output; otherwise it writes unnormalised partial sums to out[(t, head, split), :] and (max, sum)
// pairs to stats, for attention_combine.wgsl (split-K decode).
struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    start: u32,
    window: u32,
    splits: u32,
    split_len: u32,
    scale: f32,
    softcap: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<vec4<f32>>;  // 16-byte words (head_dim % 4 == 0)
@group(0) @binding(3) var<storage, read> v_cache: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;

const MAX_DIM: u32 = 256u;  // head_dim limit: each thread owns head_dim / 64 output values
const EMPTY: f32 = -3.0e38;  // below any finite score

var<workgroup> q_tile: array<vec4<f32>, 64>;
var<workgroup> scores: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let head = wid.x;
    let t = wid.y;
    let split = wid.z;
    let kv_head = head / (p.heads / p.kv_heads);
    let d = p.head_dim;
    let pos = p.start + t;
    var lo = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        lo = pos + 1u - p.window;
    }
    let first = max(lo, split * p.split_len);
    let end = min(pos + 1u, (split + 1u) * p.split_len);  // exclusive

    let q_base = (t * p.heads + head) * d;
    for (var i = lid; i < d / 4u; i += 64u) {
        let at = q_base + 4u * i;
        q_tile[i] = vec4<f32>(q[at], q[at + 1u], q[at + 2u], q[at + 3u]);
    }
    workgroupBarrier();

    var m = EMPTY;
    var l = 0.0;
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    let kv_stride = p.kv_heads * d;
    for (var tile = first; tile < end; tile += 64u) {
        let j = tile + lid;
        var s = EMPTY;
        if (j < end) {
            let k_base = (j * kv_stride + kv_head * d) / 4u;
            var total = 0.0;
            for (var i = 0u; i < d / 4u; i++) {
                total += dot(q_tile[i], k_cache[k_base + i]);
            }
            s = total * p.scale;
            if (p.softcap > 0.0) {
                let e = exp(2.0 * clamp(s / p.softcap, -15.0, 15.0));
                s = p.softcap * (e - 1.0) / (e + 1.0);
            }
        }
        scores[lid] = s;
        workgroupBarrier();
        var tile_max = EMPTY;
        for (var r = 0u; r < 64u; r++) {
            tile_max = max(tile_max, scores[r]);
        }
        let m_new = max(m, tile_max);
        let correction = exp(m - m_new);
        l *= correction;
        for (var c = 0u; c < 4u; c++) {
            acc[c] *= correction;
        }
        let count = min(64u, end - tile);
        for (var r = 0u; r < count; r++) {
            let weight = exp(scores[r] - m_new);
            l += weight;
            let v_base = (tile + r) * kv_stride + kv_head * d;
            for (var c = 0u; c < 4u; c++) {
                let i = lid + 64u * c;
                if (i < d) {
                    acc[c] += weight * v_cache[v_base + i];
                }
            }
        }
        m = m_new;
        workgroupBarrier();
    }

    let row = (t * p.heads + head) * p.splits + split;
    for (var c = 0u; c < 4u; c++) {
        let i = lid + 64u * c;
        if (i < d) {
            if (p.splits == 1u) {
                out[q_base + i] = select(0.0, acc[c] / l, l > 0.0);
            } else {
                out[row * d + i] = acc[c];
            }
        }
    }
    if (lid == 0u) {
        stats[row * 2u] = m;
        stats[row * 2u + 1u] = l;
    }
}
