// ids[r] = index of the largest logits[r, :] (the lowest index among equal maxima), one workgroup per row.
// WG threads a workgroup: elementwise.py sets it as wide as the device allows (a vocabulary row is long).
const WG: u32 = 64u;
struct Params {
    cols: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;

var<workgroup> best_value: array<f32, WG>;
var<workgroup> best_index: array<u32, WG>;

fn better(v: f32, i: u32, w: f32, j: u32) -> bool {
    return v > w || (v == w && i < j);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wid.x * p.cols;
    var v = -3.4028235e38;
    var i = 0xffffffffu;
    for (var k = lid; k < p.cols; k += WG) {
        let c = logits[base + k];
        if (better(c, k, v, i)) {
            v = c;
            i = k;
        }
    }
    best_value[lid] = v;
    best_index[lid] = i;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride && better(best_value[lid + stride], best_index[lid + stride], best_value[lid], best_index[lid])) {
            best_value[lid] = best_value[lid + stride];
            best_index[lid] = best_index[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        ids[wid.x] = select(best_index[0], 0u, best_index[0] == 0xffffffffu);
    }
}
