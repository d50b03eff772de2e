// The gathered gate/up product of the chosen experts, activation included:
// h[s, r] = act(gate_e[r] . x[t]) * (up_e[r] . x[t]) for slot s (token t = s / top_k, expert e = ids[s]).
// The experts' matrices lie in one stack, expert after expert, each expert its gate rows then its up rows
// (per_expert = 2 * rows of them); this dispatch's binding holds experts expert_lo .. expert_hi - 1 from its
// row 0. A slot whose expert lies elsewhere reads nothing (another dispatch covers it), and an expert no
// slot chose is never read: the cost follows the chosen experts only.
// One workgroup per (row, slot): its 64 threads share the row's 32-value units (decode_unit of the fmt file).
struct Params {
    rows: u32,
    cols: u32,
    top_k: u32,
    expert_lo: u32,
    expert_hi: u32,
    per_expert: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wt: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> h: array<f32>;

var<workgroup> partial: array<vec2<f32>, 64>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let r = wid.z * groups.x + wid.x;
    let s = wid.y;
    let e = ids[s];
    let live = r < p.rows && e >= p.expert_lo && e < p.expert_hi;
    let x_base = (s / p.top_k) * p.cols;
    let units = (p.cols + 31u) / 32u;
    var acc = vec2<f32>(0.0);
    var vals: array<f32, 32>;
    if (live) {
        let gate_row = (e - p.expert_lo) * p.per_expert + r;
        for (var u = lid; u < units; u += 64u) {
            decode_unit(gate_row, u, &vals);
            var g = 0.0;
            for (var i = 0u; i < 32u; i++) {
                g += vals[i] * x[x_base + min(u * 32u + i, p.cols - 1u)];
            }
            decode_unit(gate_row + p.rows, u, &vals);
            var v = 0.0;
            for (var i = 0u; i < 32u; i++) {
                v += vals[i] * x[x_base + min(u * 32u + i, p.cols - 1u)];
            }
            acc += vec2<f32>(g, v);
        }
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u && live) {
        h[s * p.rows + r] = ACTIVATION(partial[0].x) * partial[0].y;
    }
}
