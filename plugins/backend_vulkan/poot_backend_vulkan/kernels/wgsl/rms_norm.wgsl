// out = h / sqrt(mean(h^2) + eps) * (w + offset), one workgroup per row, with h = x or, in the
// fused variant (lines marked FUSED), h = x + residual, also stored to h_out for the next residual.
struct Params {
    cols: u32,
    eps: f32,
    offset: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
//FUSED @group(0) @binding(4) var<storage, read> residual: array<f32>;
//FUSED @group(0) @binding(5) var<storage, read_write> h_out: array<f32>;

fn load(i: u32) -> f32 {
    var h = x[i];
    //FUSED h += residual[i];
    return h;
}

const THREADS: u32 = 64u;

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wid.x * p.cols;
    var squares = 0.0;
    for (var k = lid; k < p.cols; k += THREADS) {
        let h = load(base + k);
        //FUSED h_out[base + k] = h;
        squares += h * h;
    }
    let inv = inverseSqrt(workgroup_sum(squares, lid) / f32(p.cols) + p.eps);
    for (var k = lid; k < p.cols; k += THREADS) {
        out[base + k] = load(base + k) * inv * (w[k] + p.offset);
    }
}
