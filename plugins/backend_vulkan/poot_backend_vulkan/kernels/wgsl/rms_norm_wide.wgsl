// rms_norm.wgsl for rows of a multiple of 4 values: 256 threads a row (THREADS) and 16-byte loads, so the one row
// of a decode step is read by the whole workgroup at once instead of 64 threads looping. Same FUSED lines; here
// the residual may be the split-K partial sums of a one-token product (gemv's partials): p.splits arrays of
// p.stride words, added in order (as gemv_combine.wgsl adds them) before the sum with x.
struct Params {
    cols: u32,
    eps: f32,
    offset: f32,
    splits: u32,
    stride: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;
//FUSED @group(0) @binding(4) var<storage, read> residual: array<vec4<f32>>;
//FUSED @group(0) @binding(5) var<storage, read_write> h_out: array<vec4<f32>>;

const THREADS: u32 = 256u;

fn load(i: u32) -> vec4<f32> {
    var h = x[i];
    //FUSED var r = residual[i];
    //FUSED for (var s = 1u; s < p.splits; s++) {
    //FUSED     r += residual[s * p.stride + i];
    //FUSED }
    //FUSED h += r;
    return h;
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let words = p.cols / 4u;
    let base = wid.x * words;
    var squares = 0.0;
    for (var k = lid; k < words; k += THREADS) {
        let h = load(base + k);
        //FUSED h_out[base + k] = h;
        squares += dot(h, h);
    }
    let inv = inverseSqrt(workgroup_sum(squares, lid) / f32(p.cols) + p.eps);
    for (var k = lid; k < words; k += THREADS) {
        out[base + k] = load(base + k) * inv * (w[k] + vec4<f32>(p.offset));
    }
}
