"""poot: load LLM checkpoints and run them on the device the machine has.

Everything a user or a plugin author needs is importable from here; plugins use nothing else of
poot_core but this module, poot_core.errors and poot_core.graph (the traced step and its shared passes).
"""

from poot_core.blocks import AttentionSpec, attention_block, gated_mlp, projection
from poot_core.checkpoint.handle import LoadOptions, ModelHandle, Parts, WeightStore
from poot_core.checkpoint.integrity import Manifest
from poot_core.checkpoint.layouts import PackedWeight, Weight, weight_kind
from poot_core.decoder import HF_ACTIVATIONS, DecoderParams, decoder_params_from_hf, trace_dense_decoder
from poot_core.driver.constraints import Constraint
from poot_core.driver.core import (
    Driver,
    DriverOptions,
    GenerateRequest,
    Generation,
    GenerationControl,
    Layout,
    Timings,
)
from poot_core.driver.embeddings import PromptEmbeddings
from poot_core.driver.encoders import CrossEncoder, SentenceEncoder
from poot_core.driver.sampling import Sampler
from poot_core.driver.speculation import DraftPolicy
from poot_core.errors import (
    CapacityError,
    CheckpointError,
    IntegrityError,
    MissingTensor,
    PluginError,
    PootError,
    Reason,
    RequestError,
    TemplateError,
    Unsupported,
)
from poot_core.executor import (
    BackendChoice,
    BackendSpec,
    Capabilities,
    Executor,
    Program,
    RunDefaults,
    check_positions,
    device_greedy,
    installed_backends,
    open_executor,
    require_ops,
)
from poot_core.family import DerivedWeight, Family, GGUFTensors, ModelConfig, StoredWeights, eos_ids, require_key
from poot_core.family_gguf import GGUFKeys, GGUFNames, split_gguf_name, unknown_tensor
from poot_core.graph import (
    EMBED_ROWS,
    EMBED_VALUES,
    GROUPS,
    SECTION_POSITIONS,
    Graph,
    Node,
    Ref,
    StateRef,
    StateSpec,
    StepShape,
    Tracer,
    Value,
    ValueRef,
    WeightRef,
)
from poot_core.moe import Expert, by_expert, choose_experts, expert_view, experts_of
from poot_core.plugins import hookimpl, lazy_executor, quiet_probe
from poot_core.registry import Registry
from poot_core.rope import inverse_frequencies, rope_attention_factor, rope_from_gguf, rope_from_hf_config

__version__ = "0.1.0"

from poot_core.distributed.coordinator import group as collective_group  # noqa: E402  (graph ops' groups)

__all__ = [
    "BackendChoice", "BackendSpec", "Capabilities", "CapacityError", "CheckpointError", "Driver",
    "DriverOptions", "Executor", "Family", "GenerateRequest", "Generation", "GenerationControl", "Graph",
    "IntegrityError", "Layout", "LoadOptions", "Manifest", "ModelConfig", "ModelHandle", "Node", "PackedWeight",
    "PluginError", "PootError", "Program", "Reason", "RunDefaults", "Registry", "RequestError", "Sampler", "StateSpec",
    "StepShape", "TemplateError", "Timings", "Tracer", "Unsupported", "Value", "Weight", "WeightStore",
    "hookimpl", "installed_backends", "inverse_frequencies", "rope_attention_factor", "rope_from_hf_config",
    "open_executor",
    "check_positions", "require_ops", "weight_kind", "Expert", "by_expert", "choose_experts", "expert_view",
    "experts_of",
    "CrossEncoder", "SentenceEncoder", "MissingTensor", "Ref", "StateRef", "ValueRef", "WeightRef",
    "AttentionSpec", "attention_block", "gated_mlp", "projection", "Parts", "DerivedWeight", "GGUFTensors",
    "GGUFKeys", "GGUFNames", "split_gguf_name", "unknown_tensor", "rope_from_gguf", "eos_ids",
    "DraftPolicy", "Constraint", "require_key", "StoredWeights",
    "DecoderParams", "decoder_params_from_hf", "trace_dense_decoder", "HF_ACTIVATIONS",
    "lazy_executor", "quiet_probe", "collective_group", "device_greedy", "PromptEmbeddings", "EMBED_ROWS",
    "EMBED_VALUES", "SECTION_POSITIONS", "GROUPS",
]
