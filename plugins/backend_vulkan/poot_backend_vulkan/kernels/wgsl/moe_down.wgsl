// The gathered down product of the chosen experts, summed with their routing weights:
// out[t, r] (+)= sum_j chosen[t, j] * (down_e[r] . h[t * top_k + j]) with e = ids[t, j].
// The experts' down matrices lie in one stack, expert after expert (per_expert rows each); this dispatch's
// binding holds experts expert_lo .. expert_hi - 1 from its row 0 and adds what they give (p.assign: the
// first such dispatch writes instead of adding). Experts no slot chose are never read.
// One workgroup per (row, token); its 64 threads share each row's 32-value units.
struct Params {
    rows: u32,
    cols: u32,
    top_k: u32,
    expert_lo: u32,
    expert_hi: u32,
    per_expert: u32,
    assign: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wt: array<u32>;
@group(0) @binding(2) var<storage, read> h: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<storage, read> chosen: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let r = wid.z * groups.x + wid.x;
    let t = wid.y;
    let units = (p.cols + 31u) / 32u;
    var acc = 0.0;
    var vals: array<f32, 32>;
    for (var j = 0u; j < p.top_k; j++) {
        let s = t * p.top_k + j;
        let e = ids[s];
        if (r < p.rows && e >= p.expert_lo && e < p.expert_hi) {
            let row = (e - p.expert_lo) * p.per_expert + r;
            var d = 0.0;
            for (var u = lid; u < units; u += 64u) {
                decode_unit(row, u, &vals);
                for (var i = 0u; i < 32u; i++) {
                    d += vals[i] * h[s * p.cols + min(u * 32u + i, p.cols - 1u)];
                }
            }
            acc += chosen[s] * d;
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
    if (lid == 0u && r < p.rows) {
        let at = t * p.rows + r;
        out[at] = select(out[at], 0.0, p.assign == 1u) + partial[0];
    }
}
