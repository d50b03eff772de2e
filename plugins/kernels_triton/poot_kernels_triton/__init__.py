"""Triton kernels shared by poot's CUDA and ROCm backends.

Every public function takes and returns torch tensors on one device (a cuda/hip device, or the CPU under
TRITON_INTERPRET=1), checks shapes on the host without reading device memory, and launches through
`launch.launch` so ahead-of-time builds can record its launches. Tiles come from `tuning`.
"""

from .activation import gated_activation
from .attention import decode_attention, prefill_attention
from .launch import Launch, record_launches
from .matmul import dense_linear
from .norm import add_rms_norm
from .planes import planes_linear, planes_rows
from .quant import GGUF_TYPES, gguf_linear, gptq_linear, linear
from .rope import apply_rope, rope_cos_sin, rotate, write_kv
from .sampling import greedy, sample
from .tuning import TUNINGS, Tile, Tuning, tuning_for_device, tuning_for_target, use_tuning

__all__ = [
    "GGUF_TYPES",
    "TUNINGS",
    "Launch",
    "Tile",
    "Tuning",
    "add_rms_norm",
    "apply_rope",
    "decode_attention",
    "dense_linear",
    "gated_activation",
    "gguf_linear",
    "gptq_linear",
    "greedy",
    "linear",
    "planes_linear",
    "planes_rows",
    "prefill_attention",
    "record_launches",
    "rope_cos_sin",
    "rotate",
    "sample",
    "tuning_for_device",
    "tuning_for_target",
    "use_tuning",
    "write_kv",
]
