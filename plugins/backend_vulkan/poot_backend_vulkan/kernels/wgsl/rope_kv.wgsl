// One dispatch for what stands between the q/k/v products and attention: q rotated into q_out, k rotated and v
// copied into their caches at rows start.. (cache_offset = start * kv_heads * head_dim). A thread per value of
// q, k and v: slot < heads is a query head, then kv_heads key heads, then kv_heads value heads. Rotation as
// rope.wgsl (the first rot_dim values of a head; neox pairs (i, i + rot_dim / 2), interleaved (2i, 2i + 1);
// factor scales cos and sin), each thread writing only its own value, so nothing is rotated in place.
// q, k and v may be the split-K partial sums of one q/k/v product (gemv's partials, one buffer bound three
// times): value i of q is the sum over s < splits of q[s * stride + q_off + i] (likewise k, v), added in the
// order gemv_combine.wgsl adds them; plain arrays are splits 1, stride 0, offsets 0.
struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    rot_dim: u32,
    interleaved: u32,
    cache_offset: u32,
    factor: f32,
    splits: u32,
    stride: u32,
    q_off: u32,
    k_off: u32,
    v_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(5) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<f32>;
@group(0) @binding(7) var<storage, read> positions: array<u32>;
@group(0) @binding(8) var<storage, read> inv_freq: array<f32>;

fn q_at(i: u32) -> f32 {
    var sum = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        sum += q[s * p.stride + p.q_off + i];
    }
    return sum;
}

fn k_at(i: u32) -> f32 {
    var sum = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        sum += k[s * p.stride + p.k_off + i];
    }
    return sum;
}

fn v_at(i: u32) -> f32 {
    var sum = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        sum += v[s * p.stride + p.v_off + i];
    }
    return sum;
}

fn rotated(value: f32, partner: f32, t: u32, d: u32) -> f32 {
    if (d >= p.rot_dim) {
        return value;
    }
    let half = p.rot_dim / 2u;
    var i = d % half;
    var first = d < half;
    if (p.interleaved != 0u) {
        i = d / 2u;
        first = d % 2u == 0u;
    }
    let angle = f32(positions[t]) * inv_freq[i];
    let c = cos(angle) * p.factor;
    let s = sin(angle) * p.factor;
    return select(value * c + partner * s, value * c - partner * s, first);
}

fn partner_of(d: u32) -> u32 {
    if (d >= p.rot_dim) {
        return d;
    }
    if (p.interleaved != 0u) {
        return d ^ 1u;
    }
    let half = p.rot_dim / 2u;
    return select(d - half, d + half, d < half);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let index = gid.y * groups.x * 64u + gid.x;
    let slots = p.heads + 2u * p.kv_heads;
    if (index >= p.tokens * slots * p.head_dim) {
        return;
    }
    let d = index % p.head_dim;
    let ts = index / p.head_dim;
    let slot = ts % slots;
    let t = ts / slots;
    let e = partner_of(d);
    if (slot < p.heads) {
        let at = (t * p.heads + slot) * p.head_dim;
        q_out[at + d] = rotated(q_at(at + d), q_at(at + e), t, d);
        return;
    }
    if (slot < p.heads + p.kv_heads) {
        let at = (t * p.kv_heads + slot - p.heads) * p.head_dim;
        k_cache[p.cache_offset + at + d] = rotated(k_at(at + d), k_at(at + e), t, d);
        return;
    }
    let at = (t * p.kv_heads + slot - p.heads - p.kv_heads) * p.head_dim;
    v_cache[p.cache_offset + at + d] = v_at(at + d);
}
