// The 16 non-linear levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
var<private> IQ4_LEVELS: array<f32, 16> = array<f32, 16>(
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
);

// The levels of the four bytes' nibbles at `shift` (0: low, 4: high) of a word.
fn iq4_levels(w: u32, shift: u32) -> vec4<f32> {
    return vec4<f32>(IQ4_LEVELS[(w >> shift) & 15u], IQ4_LEVELS[(w >> (shift + 8u)) & 15u],
                     IQ4_LEVELS[(w >> (shift + 16u)) & 15u], IQ4_LEVELS[(w >> (shift + 24u)) & 15u]);
}
