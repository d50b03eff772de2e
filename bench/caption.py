"""Captioning speed: image-to-first-token time and decode tok/s of a SmolVLM-256M-shaped, a Qwen2.5-VL-3B-shaped
and (with --models) a Gemma-3-4B-shaped model (random weights) through poot's VisionLanguageModel, beside
transformers' generate on the same checkpoint files, in the same run, on the same device.

  python bench/caption.py [--backend cpu|cuda] [--models smolvlm-256m,qwen2.5-vl-3b,gemma3-4b] [--text-layers N]
                          [--vision-layers N] [--new N] [--repeats N] [--qwen-side S]

--backend cpu (default): float32, 2 text and 2 vision layers, 8 new tokens, a 224-pixel Qwen image (the machine
is a shared 2-core one), the same torch threads for both. --backend cuda: the Triton executor on the GPU in
bf16 (decode steps replayed as CUDA graphs) beside transformers' bf16 model on the same GPU (its default
attention), every layer of the real shapes, 64 new tokens, a 448-pixel Qwen image; one untimed warm-up run of
each first (kernel compiles); the decode floor is the bytes a token reads (the text model's matrices and the
KV written so far) at the device's copy bandwidth.

The first token's time runs from the PIL image (preprocessing included, for both) to the first greedy token;
decode is the tokens after it over the time after it. SmolVLM's frame is the tower's 512 x 512 without image
splitting (one frame, 64 image tokens); Gemma 3's the tower's 896 x 896 (256 image tokens, which attend to each
other both ways); Qwen2.5-VL's image is qwen-side square (224: 16 x 16 patches, 64 image
tokens; 448: 256; with 2 vision layers they keep one window layer and one full-attention layer). Runs of the
two alternate; the best of the repeats is kept. Writes bench/results/caption.json (caption_cuda.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def image(side_w: int, side_h: int, seed: int = 1) -> Image.Image:
    """A smooth gradient with noise and a bright square (a photo-like image to resize)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side_h, 0:side_w]
    rgb = np.stack([255 * x / side_w, 255 * y / side_h, 128 + 60 * np.sin(x / 5.0 + y / 7.0)], axis=-1)
    rgb = np.clip(rgb + rng.normal(0, 20, rgb.shape), 0, 255)
    rgb[side_h // 4 : side_h // 2, side_w // 3 : side_w // 2] = 250
    return Image.fromarray(rgb.astype(np.uint8))


def save_tokenizer(path: Path) -> None:
    """A small word-level tokenizer.json (the prompts here are token ids; poot's loader wants the file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "a", "b"])}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


class Clock:
    """Times of the first and the last new token (poot's on_token; transformers' streamer, whose first put is
    the prompt)."""

    def __init__(self, skip_first_put: bool = False) -> None:
        self.t0, self.times, self.tokens, self._skip = time.perf_counter(), [], [], skip_first_put

    def __call__(self, token: Any) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(int(token.reshape(-1)[0]) if isinstance(token, torch.Tensor) else int(token))

    def put(self, value: Any) -> None:
        if self._skip:
            self._skip = False
            return
        self(value)

    def end(self) -> None:
        pass

    def figures(self) -> dict[str, float]:
        first, last = self.times[0] - self.t0, self.times[-1] - self.times[0]
        return {"first_token_s": first, "decode_tok_s": (len(self.times) - 1) / last if last > 0 else 0.0}


def build(cls: Any, cfg: Any, path: Path, device: str, dtype: torch.dtype) -> Any:
    """The random model made on the device in `dtype`, saved under `path` (poot loads the files)."""
    with torch.device(device):
        model = cls(cfg).to(dtype).eval()
    model.save_pretrained(path)
    return model


def with_layers(raw: dict[str, Any], text_layers: int | None, vision_layers: int | None) -> tuple[dict, dict]:
    """The text and vision configs of a shape with their layer counts cut to the given ones (None: all)."""
    text, vis = raw["text_config"], raw["vision_config"]
    return (dict(text, num_hidden_layers=text_layers or text["num_hidden_layers"]),
            dict(vis, num_hidden_layers=vision_layers or vis["num_hidden_layers"]))


def smolvlm(path: Path, text_layers: int | None, vision_layers: int | None, device: str,
            dtype: torch.dtype) -> tuple[Any, Any, list[int], Image.Image]:
    raw = common.hf_config("smolvlm_256m")
    text, vis = with_layers(raw, text_layers, vision_layers)
    cfg = tf.SmolVLMConfig(text_config=text, vision_config=vis, scale_factor=raw["scale_factor"],
                           image_token_id=raw["image_token_id"])
    model = build(tf.SmolVLMForConditionalGeneration, cfg, path, device, dtype)
    side = vis["image_size"]
    processor = tf.Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": side},
                                             max_image_size={"longest_edge": side})
    processor.save_pretrained(path)
    tokens = (side // vis["patch_size"]) ** 2 // raw["scale_factor"] ** 2
    prompt = [1, 100, 200, 49189, 49152] + [raw["image_token_id"]] * tokens + [49189, 300, 400, 500]

    def reference(img: Image.Image, new: int, clock: Clock) -> None:
        pixels = processor(images=[[img]], return_tensors="pt")["pixel_values"].to(device, dtype)
        ids = torch.tensor([prompt], device=device)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                       max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                       pad_token_id=0, streamer=clock)

    return model, reference, prompt, image(640, 480)


def qwen25vl(path: Path, text_layers: int | None, vision_layers: int | None, side: int, device: str,
             dtype: torch.dtype) -> tuple[Any, Any, list[int], Image.Image]:
    raw = common.hf_config("qwen25vl_3b")
    text = dict(raw["text_config"], num_hidden_layers=text_layers or raw["text_config"]["num_hidden_layers"])
    vision_layers = vision_layers or raw["vision_config"]["depth"]
    full = [i for i in raw["vision_config"]["fullatt_block_indexes"] if i < vision_layers] or [vision_layers - 1]
    vis = dict(raw["vision_config"], depth=vision_layers, fullatt_block_indexes=full)
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vis, image_token_id=raw["image_token_id"],
                              vision_start_token_id=raw["vision_start_token_id"],
                              vision_end_token_id=raw["vision_end_token_id"],
                              tie_word_embeddings=raw["tie_word_embeddings"])
    model = build(tf.Qwen2_5_VLForConditionalGeneration, cfg, path, device, dtype)
    processor = tf.Qwen2VLImageProcessorPil()
    processor.save_pretrained(path)
    img = image(side, side)
    grid = processor(images=[img], return_tensors="pt")["image_grid_thw"]
    image_id = raw["image_token_id"]
    prompt = [100, 200, raw["vision_start_token_id"]] + [image_id] * (int(grid.prod()) // 4) + \
        [raw["vision_end_token_id"], 300, 400]

    def reference(img: Image.Image, new: int, clock: Clock) -> None:
        out = processor(images=[img], return_tensors="pt")
        ids = torch.tensor([prompt], device=device)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       pixel_values=out["pixel_values"].to(device, dtype),
                       image_grid_thw=out["image_grid_thw"].to(device), mm_token_type_ids=(ids == image_id).int(),
                       max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                       pad_token_id=0, streamer=clock)

    return model, reference, prompt, img


def gemma3(path: Path, text_layers: int | None, vision_layers: int | None, device: str,
           dtype: torch.dtype) -> tuple[Any, Any, list[int], Image.Image]:
    raw = common.hf_config("gemma3_4b")
    text, vis = with_layers(raw, text_layers, vision_layers)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vis, mm_tokens_per_image=raw["mm_tokens_per_image"],
                          image_token_index=raw["image_token_index"], boi_token_index=raw["boi_token_index"],
                          eoi_token_index=raw["eoi_token_index"])
    model = build(tf.Gemma3ForConditionalGeneration, cfg, path, device, dtype)
    side = vis["image_size"]
    processor = tf.Gemma3ImageProcessorPil(size={"height": side, "width": side})
    processor.save_pretrained(path)
    image_id = raw["image_token_index"]
    prompt = [2, 100, 200, raw["boi_token_index"]] + [image_id] * raw["mm_tokens_per_image"] + \
        [raw["eoi_token_index"], 300, 400]

    def reference(img: Image.Image, new: int, clock: Clock) -> None:
        pixels = processor(images=[img], return_tensors="pt")["pixel_values"].to(device, dtype)
        ids = torch.tensor([prompt], device=device)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                       token_type_ids=(ids == image_id).long(), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)

    return model, reference, prompt, image(640, 480)


def text_bytes(model: Any) -> int:
    """The bytes of the matrices a decode token reads: every weight but the vision tower's, the connector's and
    the token embedding table (a gather of one row), the output head counted once (tied or not)."""
    seen: dict[int, int] = {}
    for name, param in list(model.named_parameters()) + [("lm_head.weight", model.lm_head.weight)]:
        if any(part in name for part in ("visual", "vision", "connector", "embed_tokens")) and "lm_head" not in name:
            continue
        seen[param.data_ptr()] = param.numel() * param.element_size()
    return sum(seen.values())


def decode_floor(model: Any, prompt: int, new: int, bandwidth: float, dtype: torch.dtype) -> float:
    """tok/s at which reading each token's weights and its KV (at the mean context) takes the copy bandwidth."""
    text = model.config.text_config
    heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = 2 * text.num_hidden_layers * heads * head_dim * (prompt + new / 2) * torch.finfo(dtype).bits // 8
    return bandwidth / (text_bytes(model) + kv)


def profile_first_token(vlm: Any, prompt: list[int], img: Image.Image, cuda: bool) -> None:
    """A diagnostic: one image to its first token under the Python profiler (host time by function), then under
    torch's profiler (device time by kernel)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    vlm.generate(prompt, [img], max_new=1, ignore_eos=True)
    if cuda:
        torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    if not cuda:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        vlm.generate(prompt, [img], max_new=1, ignore_eos=True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


def run(name: str, args: argparse.Namespace, bandwidth: float | None) -> dict[str, Any]:
    from poot_family_vision.runtime import VisionLanguageModel

    cuda = args.backend == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        common.log(f"{name}: building {args.text_layers or 'all'} text and {args.vision_layers or 'all'} vision "
                   f"layers on {device} in {dtype} ...")
        if name == "smolvlm-256m":
            model, reference, prompt, img = smolvlm(path, args.text_layers, args.vision_layers, device, dtype)
        elif name == "gemma3-4b":
            model, reference, prompt, img = gemma3(path, args.text_layers, args.vision_layers, device, dtype)
        else:
            model, reference, prompt, img = qwen25vl(path, args.text_layers, args.vision_layers, args.qwen_side,
                                                     device, dtype)
        save_tokenizer(path)
        vlm = VisionLanguageModel.load(path, executor=args.backend, capacity=len(prompt) + args.new + 8)
        floor = decode_floor(model, len(prompt), args.new, bandwidth, dtype) if bandwidth else None
        poot_runs, hf_runs, tokens = [], [], {}
        if cuda:  # kernel compiles and the allocators' first growth, for both
            common.log("  warm-up ...")
            vlm.generate(prompt, [img], max_new=args.new, ignore_eos=True)
            with torch.no_grad():
                reference(img, args.new, Clock(skip_first_put=True))
            torch.cuda.synchronize()
        for r in range(args.repeats):
            clock = Clock()
            vlm.generate(prompt, [img], max_new=args.new, ignore_eos=True, on_token=clock)
            poot_runs.append(clock.figures())
            tokens["poot"] = clock.tokens
            clock = Clock(skip_first_put=True)
            with torch.no_grad():
                reference(img, args.new, clock)
            hf_runs.append(clock.figures())
            tokens["transformers"] = clock.tokens
            common.log(f"  round {r}: poot {poot_runs[-1]}, transformers {hf_runs[-1]}")
        if args.profile:
            profile_first_token(vlm, prompt, img, cuda)
        del model, vlm
        if cuda:
            torch.cuda.empty_cache()

    def best(runs: list[dict[str, float]]) -> dict[str, float]:
        return {"first_token_s": min(x["first_token_s"] for x in runs),
                "decode_tok_s": max(x["decode_tok_s"] for x in runs)}

    ours, theirs = best(poot_runs), best(hf_runs)
    result = {"prompt_tokens": len(prompt), "new_tokens": args.new, "poot": ours, "transformers": theirs,
              "tokens_equal": tokens["poot"] == tokens["transformers"],
              "tokens_shared": common.equal_prefix(tokens["poot"], tokens["transformers"]),
              "first_token_speedup": theirs["first_token_s"] / ours["first_token_s"],
              "decode_speedup": ours["decode_tok_s"] / theirs["decode_tok_s"] if theirs["decode_tok_s"] else None,
              "decode_floor_tok_s": floor, "rounds": {"poot": poot_runs, "transformers": hf_runs}}
    floor_text = f", floor {floor:.0f} tok/s ({ours['decode_tok_s'] / floor:.0%})" if floor else ""
    common.log(f"{name}: first token {ours['first_token_s'] * 1e3:.1f} ms vs {theirs['first_token_s'] * 1e3:.1f} ms "
               f"({result['first_token_speedup']:.2f}x); decode {ours['decode_tok_s']:.1f} vs "
               f"{theirs['decode_tok_s']:.1f} tok/s ({result['decode_speedup']:.2f}x){floor_text}; "
               f"greedy tokens shared {result['tokens_shared']}/{args.new}")
    return result


# per backend, what each flag left out means; None layers: the real shape's
DEFAULTS = {"cpu": {"text_layers": 2, "vision_layers": 2, "new": 8, "repeats": 2, "qwen_side": 224},
            "cuda": {"text_layers": None, "vision_layers": None, "new": 64, "repeats": 3, "qwen_side": 448}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(DEFAULTS), default="cpu")
    parser.add_argument("--models", default="smolvlm-256m,qwen2.5-vl-3b")
    parser.add_argument("--text-layers", type=int, default=None, help="cpu: 2; cuda: the real shape's")
    parser.add_argument("--vision-layers", type=int, default=None, help="cpu: 2; cuda: the real shape's")
    parser.add_argument("--new", type=int, default=None, help="cpu: 8; cuda: 64")
    parser.add_argument("--repeats", type=int, default=None, help="cpu: 2; cuda: 3")
    parser.add_argument("--qwen-side", type=int, default=None, help="cpu: 224; cuda: 448")
    parser.add_argument("--out", default=None, help="results/<out>.json (caption, caption_cuda)")
    parser.add_argument("--profile", action="store_true", help="then profile one image to its first token")
    args = parser.parse_args()
    for flag, default in DEFAULTS[args.backend].items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    cuda = args.backend == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--backend cuda needs a CUDA GPU")
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    common.log(f"load average {load:.2f}, torch threads {torch.get_num_threads()}")
    bandwidth = common.decode_bandwidth()[0] if cuda else None
    results = {name: run(name, args, bandwidth) for name in args.models.split(",")}
    payload = {"backend": args.backend, "load_average": load, "load_average_after": os.getloadavg()[0],
               "text_layers": args.text_layers or "all", "vision_layers": args.vision_layers or "all",
               "qwen_side": args.qwen_side, "dtype": "bfloat16" if cuda else "float32", "weights": "random",
               "models": results}
    if cuda:
        payload |= {"device": torch.cuda.get_device_name(), "copy_GBps": bandwidth / 1e9}
    path = common.write(args.out or ("caption_cuda" if cuda else "caption"), payload)
    common.log(f"wrote {path}")


if __name__ == "__main__":
    main()
