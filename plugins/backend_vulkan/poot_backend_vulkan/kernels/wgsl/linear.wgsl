// y[t, row_offset + r] = sum_k W[r, k] * x[t, k] for one row-chunk of W (a binding of at most
// maxStorageBufferBindingSize bytes). One workgroup per (row, group of 4 tokens); the 64 threads
// share the row's 32-value units, so each unit is decoded once for 4 tokens. The BIAS variant adds
// bias[n] to every output column n. linear.py makes TOKENS 1 for a one-token step (a decode of a packed format).
struct Params {
    rows: u32,
    cols: u32,
    row_offset: u32,
    out_cols: u32,
    tokens: u32,
    first_row: u32,  // the chunk's first row within its buffer (a matrix inside a concatenation)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wt: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
//BIAS @group(0) @binding(4) var<storage, read> bias: array<f32>;

const TOKENS: u32 = 4u;
var<workgroup> partial: array<vec4<f32>, 64>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.z * groups.x + wid.x;
    let t0 = wid.y * TOKENS;
    let units = (p.cols + 31u) / 32u;
    var acc = vec4<f32>(0.0);
    var vals: array<f32, 32>;
    if (row < p.rows) {
        for (var u = lid; u < units; u += 64u) {
            decode_unit(p.first_row + row, u, &vals);
            for (var tt = 0u; tt < TOKENS; tt++) {
                let t = min(t0 + tt, p.tokens - 1u);
                var s = 0.0;
                for (var i = 0u; i < 32u; i++) {
                    let k = min(u * 32u + i, p.cols - 1u);
                    s += vals[i] * x[t * p.cols + k];
                }
                acc[tt] += s;
            }
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
    if (lid < TOKENS && row < p.rows && t0 + lid < p.tokens) {
        var value = partial[0][lid];
        //BIAS value += bias[p.row_offset + row];
        y[(t0 + lid) * p.out_cols + p.row_offset + row] = value;
    }
}
