"""llama-cli's flags that poot does not take, each with what poot offers instead.

`poot generate` takes llama-cli's flags where poot has the capability; every other one of llama-cli's (and
llama-completion's) flags is refused by name with one of these notes rather than misparsed or ignored.
"""

from __future__ import annotations

_ONE_DEVICE = ("poot runs the whole model on the one device --backend picks (auto: a GPU when one is present, "
               "else the CPU); choose it with --backend cpu|cuda|rocm|vulkan")
_PLACEMENT = "poot places the weights and the KV cache on the --backend device itself"
_SAMPLING = "poot samples with --temp, --top-k, --top-p, --min-p, --repeat-penalty and -s only"
_CPU_PINNING = "poot sets only the CPU thread counts: -t (decode) and -tb (prefill)"
_NO_DOWNLOAD = "poot never downloads models; pass a local checkpoint (a safetensors directory or .gguf) with -m"
_TEXT_ONLY = "poot generate is text only"
_NO_SERVER = "poot's command line has no server"
_NO_SPECULATIVE = ("poot's speculative decoding takes -md FILE (a draft model), --lookup (prompt lookup) or "
                   "--mtp N, with --draft-max and --draft-min")
_ROPE = "poot reads rope scaling from the checkpoint's config"
_NO_SHIFT = ("poot does not shift the context: a reply that fills -c stops with 'context full' "
             "(in --conversation, /reset starts over)")
_LOGGING = "poot logs what the run does to stderr with -v, and nothing otherwise"
_KV_TYPE = "the KV cache's type is the backend's own (float32 on the CPU)"
_NO_ADAPTERS = "poot loads no adapters or control vectors"
_ONE_SEQUENCE = "poot generate runs one sequence"

_GROUPS: list[tuple[tuple[str, ...], str]] = [
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), _ONE_DEVICE),
    (("-dev", "--device", "--list-devices", "-sm", "--split-mode", "-mg", "--main-gpu",
      "--rpc"), _ONE_DEVICE + "; `poot plugins` lists the backends; several devices: --tp N (llama.cpp's "
                "-sm row) or --pp N (-sm layer), with --tensor-split shares"),
    (("-cnv",), "use --conversation (poot has no short form)"),
    (("-no-cnv",), "use --no-conversation (poot has no short form)"),
    (("-st",), "use --single-turn (poot has no short form)"),
    (("-sys",), "use --system-prompt (poot has no short form)"),
    (("-sysf", "--system-prompt-file"), 'use --system-prompt "$(cat FILE)"'),
    (("-i", "--interactive", "-if", "--interactive-first"),
     "use --conversation: an interactive chat when stdin is a terminal"),
    (("-mli", "--multiline-input"), "--conversation takes multi-line input: end a line with \\ to continue it"),
    (("--in-prefix", "--in-suffix", "--in-prefix-bos", "--spm-infill"),
     "the chat template frames every turn; give another with --chat-template-file"),
    (("-e", "--escape", "--no-escape"),
     "poot takes -p as written, with no escape processing; use the shell's $'...' quoting or -f FILE"),
    (("-sp", "--special"), "poot always prints special tokens the model generates"),
    (("--jinja", "--no-jinja"),
     "poot always renders the model's jinja chat template; --no-chat-template continues the text instead"),
    (("--chat-template-kwargs", "--reasoning-format", "-rea", "--reasoning", "--reasoning-effort",
      "--reasoning-budget", "--reasoning-budget-message", "--reasoning-preserve", "--no-reasoning-preserve",
      "--skip-chat-parsing", "--no-skip-chat-parsing", "--prefill-assistant", "--no-prefill-assistant"),
     "poot renders the chat template with the messages only and prints the reply as generated"),
    (("-ub", "--ubatch-size"), "poot has one prefill step size: -b"),
    (("-fa", "--flash-attn"), "poot chooses its attention kernels itself"),
    (("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"), _KV_TYPE),
    (("-kvo", "--kv-offload", "-nkvo", "--no-kv-offload", "--repack", "-nr", "--no-repack", "--no-host",
      "--op-offload", "--no-op-offload", "-ot", "--override-tensor", "-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe",
      "-ncffn", "--n-cpu-ffn", "-fit", "--fit", "-fitp", "--fit-print", "-fitt", "--fit-target", "-fitc",
      "--fit-ctx", "--mmproj-offload", "--no-mmproj-offload"), _PLACEMENT),
    (("-lm", "--load-mode", "-lzm", "--lazy-mode", "--numa"),
     "poot memory-maps the checkpoint and reads weights as the steps need them"),
    (("--check-tensors",), "use `poot manifest` and LoadOptions(integrity=...) to check a checkpoint's files"),
    (("--override-kv",), "poot reads the checkpoint's metadata as it is"),
    (("-C", "--cpu-mask", "-Cr", "--cpu-range", "--cpu-strict", "--prio", "--poll", "-Cb", "--cpu-mask-batch",
      "-Crb", "--cpu-range-batch", "--cpu-strict-batch", "--prio-batch", "--poll-batch"), _CPU_PINNING),
    (("--samplers", "--sampler-seq", "--sampling-seq", "--top-nsigma", "--top-n-sigma", "--xtc-probability",
      "--xtc-threshold", "--typical", "--typical-p", "--repeat-last-n", "--presence-penalty",
      "--frequency-penalty", "--dry-multiplier", "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
      "--dry-sequence-breaker", "--adaptive-target", "--adaptive-decay", "--dynatemp-range", "--dynatemp-exp",
      "--mirostat", "--mirostat-lr", "--mirostat-ent", "-l", "--logit-bias", "-bs", "--backend-sampling"),
     _SAMPLING),
    (("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx",
      "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast", "-gan", "--grp-attn-n",
      "-gaw", "--grp-attn-w"), _ROPE),
    (("--context-shift", "--no-context-shift", "--keep", "--swa-full", "-ctxcp", "--ctx-checkpoints",
      "--swa-checkpoints", "-cram", "--cache-ram", "-dt", "--defrag-thold", "-kvu", "--kv-unified", "-no-kvu",
      "--no-kv-unified", "--kv-unified-per-slot"), _NO_SHIFT),
    (("-np", "--parallel", "-ns", "--sequences", "-cb", "--cont-batching", "-nocb", "--no-cont-batching"),
     _ONE_SEQUENCE),
    (("--prompt-cache", "--prompt-cache-all", "--prompt-cache-ro"),
     "a --conversation keeps its K/V in memory between turns; /save FILE writes the messages"),
    (("-mm", "--mmproj", "-mmu", "--mmproj-url", "--mmproj-auto", "--no-mmproj", "--no-mmproj-auto", "-mmdev",
      "--mmproj-device", "--image", "--audio", "--video", "--image-min-tokens", "--image-max-tokens",
      "--mtmd-batch-max-tokens", "--video-fps", "--video-timestamp-interval", "--video-ffmpeg-dir"), _TEXT_ONLY),
    (("-mu", "--model-url", "-dr", "--docker-repo", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft",
      "--hf-token", "--offline", "-cl", "--cache-list", "--gpt-oss-20b-default", "--gpt-oss-120b-default",
      "--vision-gemma-4b-default", "--vision-gemma-12b-default", "--spec-default"), _NO_DOWNLOAD),
    (("--lora", "--lora-scaled", "--control-vector", "--control-vector-scaled", "--control-vector-layer-range",
      "--lora-init-without-apply"), _NO_ADAPTERS),
    (("-co", "--color", "--simple-io", "--display-prompt", "--no-display-prompt", "--log-disable", "--log-file",
      "--log-jsonl", "--no-log-jsonl", "--log-prompts-dir", "--log-colors", "-lv", "--verbosity",
      "--log-verbosity", "--log-prefix", "--no-log-prefix", "--log-timestamps", "--no-log-timestamps"), _LOGGING),
    (("--perf", "--no-perf"), "use --show-timings / --no-show-timings"),
    (("-ptc", "--print-token-count"), "-v and --verbose-prompt show the token counts"),
    (("-o", "--output", "--output-file"), "redirect stdout: the reply is printed there"),
    (("-bf", "--binary-file", "--in-file"), "use -f FILE"),
    (("--warmup", "--no-warmup"), "poot prepares its step programs when it loads the model"),
    (("--usage",), "use --help"),
    (("--completion-bash",), "poot has no completion script"),
    (("--server-base", "-a", "--alias", "--tags", "--host", "--port", "--api-key", "--api-key-file", "-to",
      "--timeout"), _NO_SERVER),
    (("-lcs", "--lookup-cache-static", "-lcd", "--lookup-cache-dynamic", "--dflash", "--eagle3", "--spec-type",
      "--draft", "--draft-n", "--draft-n-min"), _NO_SPECULATIVE),
    (("--chunks",), "--chunks applies to `poot perplexity`"),
]

# llama-cli's short names of its draft-model (speculative decoding) flags
_DRAFT_SHORT = frozenset(("-hfd", "-hfrd", "-td", "-tbd", "-Cd", "-Crd", "-Cbd", "-Crbd", "-ctkd", "-ctvd", "-otd",
                          "-cmoed", "-ncmoed", "-devd", "-ngld"))

ADVICE: dict[str, str] = {name: advice for names, advice in _GROUPS for name in names}


def unknown_flag_message(name: str, prog: str) -> str:
    """One line: the flag is not one of this command's, and what to use instead."""
    advice = ADVICE.get(name)
    if advice is None and (name.endswith("-draft") or "-spec-" in name or name.startswith("--draft")
                           or name in _DRAFT_SHORT):
        advice = _NO_SPECULATIVE
    if advice is None:
        return f"unknown flag {name}"
    return f"{prog} does not take llama-cli's {name}: {advice}"
