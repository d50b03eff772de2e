// act: 0 silu, 1 gelu (tanh), 2 gelu (erf), 3 relu, 4 sigmoid.
inline float activate(float x, int act) {
    if (act == 0) return x / (1.0f + exp(-x));
    if (act == 1) return 0.5f * x * (1.0f + tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    if (act == 2) return 0.5f * x * (1.0f + erf(x * 0.7071067811865476f));
    if (act == 3) return fmax(x, 0.0f);
    return 1.0f / (1.0f + exp(-x));
}
