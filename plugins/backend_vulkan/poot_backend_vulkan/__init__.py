"""poot-backend-vulkan: the llama family on any Vulkan device, through WGSL compute shaders run by wgpu.

It holds no torch tensors on the device; weights stay in their stored layout (f32, f16, bf16, GGUF blocks).
"""

__version__ = "0.1.0"
