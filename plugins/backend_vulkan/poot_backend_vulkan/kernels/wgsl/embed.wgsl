// out[t, :] = scale * table[ids[t], :] for the ids that fall in this row-chunk of the table.
struct Params {
    rows: u32,
    cols: u32,
    row_offset: u32,
    out_cols: u32,
    tokens: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wt: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let index = gid.y * groups.x * 64u + gid.x;
    let units = (p.cols + 31u) / 32u;
    if (index >= p.tokens * units) {
        return;
    }
    let t = index / units;
    let u = index % units;
    let id = ids[t];
    if (id < p.row_offset || id >= p.row_offset + p.rows) {
        return;
    }
    var vals: array<f32, 32>;
    decode_unit(id - p.row_offset, u, &vals);
    for (var i = 0u; i < 32u; i++) {
        let k = u * 32u + i;
        if (k < p.cols) {
            out[t * p.cols + k] = vals[i] * p.scale;
        }
    }
}
