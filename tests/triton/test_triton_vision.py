"""The vision-language families on the shared Triton executor, against the CPU executor on the same tiny random
float32 checkpoints and Pillow-made images: the vision tower's features (SigLIP with a pixel shuffle, SigLIP
with average pooling, Qwen2.5-VL's windowed ViT with its 2D rope and patch merger), the whole prompt's logits
with the features spliced in (Gemma 3's image tokens attending both ways, Qwen2.5-VL's M-RoPE), and greedy
tokens. Also the two ops a step with images adds (splice, group_attention) against their definitions.

Without a GPU the executor runs under the Triton interpreter (eager steps); with one, on the GPU with the decode
steps replayed as CUDA graphs (M-RoPE's float32 masks among their inputs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip
from PIL import ImageOps
from poot_family_vision.runtime import VisionLanguageModel

from helpers import gemma3_vision as g3
from helpers import qwen25vl as q25
from helpers import tiny, vision
from helpers.triton_mode import interpreted
from poot_core import Driver, DriverOptions, Layout, ModelHandle, RequestError, StepShape, Tracer
from poot_kernels_triton import prefill_attention
from poot_kernels_triton.executor import TritonExecutor
from poot_kernels_triton.images import device_limits, group_check, group_limits

BOUND, NEW = 1e-4, 3
IMAGES = vision.IMAGES[:1]  # 97 x 53


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def triton_executor() -> TritonExecutor:
    return TritonExecutor.on_interpreter() if interpreted() else TritonExecutor(0)


def _smolvlm(path: Path) -> list[int]:
    vision.checkpoint(path)
    return [0, 17, 33, 48, 10, 11] + [vision.IMAGE_TOKEN] * vision.TOKENS_PER_IMAGE + [10, 60, 71, 5]


def _gemma3(path: Path) -> list[int]:
    g3.checkpoint(path)
    return [0, 17, 33, 48, g3.BOI] + [g3.IMAGE_TOKEN] * g3.TOKENS_PER_IMAGE + [g3.EOI, 55, 60, 71, 5]


def _qwen25vl(path: Path) -> list[int]:
    q25.build(q25.config(), seed=3).save_pretrained(path)
    tiny.save_tokenizer(path)
    q25.processor().save_pretrained(path)
    merged = 4 * 6 // 4  # the image's grid (1, 4, 6): windows of 2 x 2 and 2 x 1 merged tokens
    return [0, 17, 33, 48, q25.VISION_START] + [q25.IMAGE_TOKEN] * merged + [q25.VISION_END, 55, 60, 71, 5]


BUILDERS = {"smolvlm": _smolvlm, "gemma3": _gemma3, "qwen2_5_vl": _qwen25vl}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pair(request, tmp_path_factory) -> tuple[VisionLanguageModel, VisionLanguageModel, list[int]]:
    path = tmp_path_factory.mktemp(request.param)
    prompt = BUILDERS[request.param](path)
    return VisionLanguageModel.load(path), VisionLanguageModel.load(path, executor=triton_executor()), prompt


def test_vision_tower_matches_cpu(pair):
    cpu, gpu, _ = pair
    pixels, layouts = cpu.frames(IMAGES)
    hidden, features = gpu.encode_images(pixels, layouts)
    ref_hidden, ref_features = cpu.encode_images(pixels, layouts)
    assert features.shape == ref_features.shape
    assert _rel(hidden, ref_hidden) <= BOUND
    assert _rel(features, ref_features) <= BOUND


def test_a_repeated_image_replays_the_tower_and_matches_cpu(pair):
    """The tower's step has no state, so on a GPU its second run of a shape is captured and later ones replay
    the CUDA graph: every run gives the CPU's features, and a second image of another size is not confused with
    the first."""
    cpu, gpu, _ = pair
    for images in (IMAGES, vision.IMAGES[1:2], IMAGES, IMAGES):
        pixels, layouts = cpu.frames(images)
        hidden, features = gpu.encode_images(pixels, layouts)
        ref_hidden, ref_features = cpu.encode_images(pixels, layouts)
        assert _rel(hidden, ref_hidden) <= BOUND and _rel(features, ref_features) <= BOUND


def test_prompt_logits_and_greedy_tokens_match_cpu(pair):
    """Every position's logits of the prompt with the image spliced in, then greedy decode steps (captured as
    CUDA graphs on a GPU): the tokens equal the CPU executor's."""
    cpu, gpu, prompt = pair
    ours, ref = gpu.logits(prompt, IMAGES), cpu.logits(prompt, IMAGES)
    assert ours.shape == ref.shape == (len(prompt), cpu.config.vocab_size)
    assert _rel(ours, ref) <= BOUND
    # the comparison can fail: without the image (features of zeros) the logits differ
    blank = cpu.logits(prompt, pixels=np.zeros_like(cpu.frames(IMAGES)[0]), layouts=cpu.frames(IMAGES)[1])
    assert _rel(ours, blank) > 1e-3
    assert gpu.generate(prompt, IMAGES, max_new=NEW, ignore_eos=True) == \
        cpu.generate(prompt, IMAGES, max_new=NEW, ignore_eos=True)


@pytest.mark.skipif(interpreted(), reason="captured replays need a GPU (the interpreter runs every step eagerly)")
def test_a_repeated_prompt_replays_its_prefill_with_each_image(pair):
    """The runtime's prompt step is marked replayed: on a GPU its second run of a shape is captured and later ones
    replay it (Gemma 3's too: its group attention makes the key limits on the device), with each run's own
    image features among the inputs: an image of the same size with other pixels between two runs of the first
    gives its own logits, and every run gives the CPU's."""
    cpu, gpu, prompt = pair
    flipped = [ImageOps.mirror(IMAGES[0])]
    for images in (IMAGES, IMAGES, flipped, IMAGES):
        assert _rel(gpu.logits(prompt, images), cpu.logits(prompt, images)) <= BOUND
    assert _rel(cpu.logits(prompt, flipped), cpu.logits(prompt, IMAGES)) > 1e-3


@pytest.mark.parametrize("arch", ["smolvlm", "qwen2_5_vl", "gemma3"])
def test_requests_with_images_in_the_serving_engine_match_cpu(tmp_path, arch):
    """SmolVLM, Qwen2.5-VL and Gemma 3 requests with images through the Triton executor's serving engine (paged
    steps, the image features spliced in as prompt embeddings, Qwen's M-RoPE by its positions by section, Gemma's
    image tokens seeing each other both ways in the one step that runs each image whole, prompts prefilled in
    chunks): the tokens the CPU runtime gives for the same images."""
    {"smolvlm": vision.checkpoint, "qwen2_5_vl": q25.chat_checkpoint, "gemma3": g3.chat_checkpoint}[arch](tmp_path)
    handle = ModelHandle.load(tmp_path)
    driver = Driver(handle, triton_executor(), DriverOptions(capacity=96, prefill_chunk=5, block_size=4,
                                                             step_tokens=16, max_running=4))
    engine = driver.serve(Layout.PAGED)
    ours = VisionLanguageModel(handle, driver.executor, capacity=96, weights=driver.weights)
    cpu = VisionLanguageModel.load(tmp_path, capacity=96)
    cases = [(vision.prompt_for(cpu, images), images) for images in (IMAGES, vision.IMAGES[1:2])]
    gens = engine.generate_batch([ours.request(p, images, max_new=NEW, ignore_eos=True) for p, images in cases])
    for gen, (prompt, images) in zip(gens, cases, strict=True):
        assert gen.tokens == cpu.generate(prompt, images, max_new=NEW, ignore_eos=True)


def _group_reference(q, k, v, start, groups, window):
    """Dense float64 attention of one row's new tokens (keys 0 .. start + T - 1): a key is seen when it is not
    after the query or both are tokens of one group; within the window when there is one."""
    tokens = q.shape[0]
    qpos = torch.arange(start, start + tokens)[:, None]
    kpos = torch.arange(start + tokens)[None, :]
    kg = torch.cat([torch.full((start,), -1), groups])[None, :]
    qg = groups[:, None]
    mask = (kpos <= qpos) | ((qg == kg) & (qg >= 0))
    if window is not None:
        mask &= qpos - kpos < window
    group = q.shape[1] // k.shape[0]
    kk, vv = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hpd->htp", q.double(), kk) / q.shape[-1] ** 0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("htp,hpd->thd", weights, vv)


@pytest.mark.parametrize("window", [None, 5])
def test_group_limits_in_the_prefill_kernel(window):
    """Keys of an earlier step, text, two images of 6 and 9 tokens: the kernel with each query's last key
    (group_limits) equals the mask's definition in float64; without the limits (plain causal) it does not."""
    torch.manual_seed(0)
    start, device = 4, triton_executor().device
    groups = torch.tensor([-1, 0, 0, 0, 0, 0, 0, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1])
    tokens = len(groups)
    q = torch.randn(tokens, 4, 16)
    k, v = torch.randn(2, start + tokens, 16), torch.randn(2, start + tokens, 16)
    limits = torch.from_numpy(group_limits(groups.numpy(), start))
    on = [t.to(device) for t in (q, k, v, limits)]
    ours = prefill_attention(*on[:3], start, window=window, limits=on[3]).cpu()
    ref = _group_reference(q, k, v, start, groups, window)
    assert float((ours.double() - ref).abs().max()) <= 1e-5
    causal = prefill_attention(*on[:3], start, window=window).cpu()
    assert float((causal.double() - ref).abs().max()) > 1e-2


def test_group_limits_refuse_a_group_in_two_runs():
    assert group_limits(np.array([-1, 0, 0, -1, 1]), 3).tolist() == [3, 5, 5, 6, 7]
    with pytest.raises(RequestError, match="not consecutive"):
        group_limits(np.array([0, 0, -1, 0]), 0)


def test_device_limits_equal_group_limits_and_the_host_check_refuses_split_groups():
    """The key limits a contiguous step makes on the device (so Gemma 3's prompt can be captured) equal
    group_limits on random groups; the host check before each run refuses a group in two runs."""
    from poot_core import Node

    rng = np.random.default_rng(0)
    for _ in range(20):
        runs = [(int(g), int(n)) for g, n in zip(rng.permutation(6) - 2, rng.integers(1, 5, 6), strict=True)]
        groups = np.array([g for g, n in runs for _ in range(n)])
        groups = np.where(groups < 0, -1, groups)
        start = int(rng.integers(0, 20))
        positions = torch.arange(start, start + len(groups))
        ours = device_limits(torch.from_numpy(groups), positions)
        assert ours.tolist() == group_limits(groups, start).tolist()
    node = Node("group_attention", ("q", "k", "v", "pos", "kc", "vc", "groups"), "o", (1, 4))
    group_check(node)({"groups": np.array([[0, 0, -1, 1]])})
    with pytest.raises(RequestError, match="not consecutive"):
        group_check(node)({"groups": np.array([[0, 0, -1, 0]])})


def test_splice_writes_the_rows_and_checks_the_index():
    """The op alone on a table's rows: features land at their flat rows; an index past the step is refused."""
    graph_tracer = Tracer(StepShape(1, 4, 4, hidden=True), {"table": (8, 3)})
    x = graph_tracer.embed(graph_tracer.weight("table"), graph_tracer.input("tokens", (1, 4)))
    out = graph_tracer.splice(x, graph_tracer.input("image_features", (2, 3), "f32"),
                              graph_tracer.input("image_index", (2,)))
    graph_tracer.output(out)
    ex = triton_executor()
    table = torch.arange(24, dtype=torch.float32).reshape(8, 3)

    class Store:
        def names(self):
            return ["table"]

        def get(self, name):
            return table

    prog = ex.prepare(graph_tracer.graph, ex.upload(Store()))
    features = np.array([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], np.float32)
    inputs = {"tokens": np.array([[1, 2, 3, 4]]), "image_features": features}
    got = ex.to_numpy(prog.run({}, inputs | {"image_index": np.array([3, 0])})[0])
    want = table[[1, 2, 3, 4]].numpy().copy()
    want[3], want[0] = features[0], features[1]
    assert np.array_equal(got[0], want)
    with pytest.raises(RequestError, match="splice index"):
        prog.run({}, inputs | {"image_index": np.array([4, 0])})
