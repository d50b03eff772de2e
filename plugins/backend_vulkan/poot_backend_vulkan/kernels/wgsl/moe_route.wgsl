// Routing of one token per workgroup (a single invocation: a router row is short): softmax over the experts'
// logits, the top_k best, their scores renormalized to sum 1 when p.norm is 1, times p.scale. Writes a dense
// row of weights, zero for every expert not chosen, and the chosen experts' ids and weights in choice order
// ([tokens, top_k] each: what the gathered expert products of moe_gate_up/moe_down.wgsl read).
struct Params {
    experts: u32,
    top_k: u32,
    norm: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> weights: array<f32>;
@group(0) @binding(3) var<storage, read_write> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> chosen: array<f32>;

@compute @workgroup_size(1)
fn main(@builtin(workgroup_id) wid: vec3<u32>) {
    let base = wid.x * p.experts;
    var top = -3.4028235e38;
    for (var e = 0u; e < p.experts; e++) {
        top = max(top, logits[base + e]);
    }
    var sum = 0.0;
    for (var e = 0u; e < p.experts; e++) {
        sum += exp(logits[base + e] - top);
        weights[base + e] = 0.0;
    }
    var taken: array<u32, 32>;  // one bit per expert, up to 1024 experts
    var total = 0.0;
    for (var k = 0u; k < p.top_k; k++) {
        var best = -1.0;
        var at = 0u;
        for (var e = 0u; e < p.experts; e++) {
            let score = exp(logits[base + e] - top) / sum;
            if ((taken[e / 32u] & (1u << (e % 32u))) == 0u && score > best) {
                best = score;
                at = e;
            }
        }
        taken[at / 32u] |= 1u << (at % 32u);
        weights[base + at] = best;
        ids[wid.x * p.top_k + k] = at;
        chosen[wid.x * p.top_k + k] = best;
        total += best;
    }
    var factor = p.scale;
    if (p.norm == 1u) {
        factor = p.scale / (total + 1e-20);
    }
    for (var e = 0u; e < p.experts; e++) {
        weights[base + e] *= factor;
    }
    for (var k = 0u; k < p.top_k; k++) {
        chosen[wid.x * p.top_k + k] *= factor;
    }
}
