// Byte-level readers over the packed weight buffer `wt` (declared by the including shader as array<u32>).
// GGUF blocks are not 4-byte aligned (Q8_0 is 34 bytes), so every field is assembled from bytes.

fn byte_at(b: u32) -> u32 {
    return (wt[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu;
}

fn half_at(b: u32) -> f32 {
    return unpack2x16float(byte_at(b) | (byte_at(b + 1u) << 8u)).x;
}

fn i8_at(b: u32) -> f32 {
    let v = i32(byte_at(b));
    return f32(select(v, v - 256, v > 127));
}
