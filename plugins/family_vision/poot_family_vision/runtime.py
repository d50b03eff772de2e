"""Running a vision-language checkpoint: the vision step once per request's images, then the text model's
prefill with the features spliced in at the image tokens, then plain decode steps over the same KV state
(one state kept for all requests, and the prepared programs of the last few step shapes: a request like an
earlier one, the same image size and prompt length, prepares nothing).

This runs on an executor directly (one sequence, contiguous KV; the prompt is prefilled in one step, so an
image's tokens, which attend to each other both ways in Gemma 3, are never split); the driver's text-only paths
serve the same checkpoint without images. A checkpoint is a Hugging Face directory, or llama.cpp's text GGUF
with its mmproj GGUF (Gemma 3, poot_family_vision.mmproj; Qwen2.5-VL, poot_family_vision.qwen25vl_gguf).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from poot_core import (
    EMBED_ROWS,
    EMBED_VALUES,
    Executor,
    GenerateRequest,
    ModelHandle,
    PromptEmbeddings,
    RequestError,
    StepShape,
    Tracer,
    device_greedy,
    open_executor,
)
from poot_family_vision.config import VisionLanguageParams
from poot_family_vision.gemma3 import image_groups
from poot_family_vision.kinds import images_of
from poot_family_vision.messages import expand_images, split_images
from poot_family_vision.model import trace_text
from poot_family_vision.preprocess import load_image

PROGRAMS = 8  # prepared step programs kept (vision towers, prefills and the decode step)


class VisionLanguageModel:
    def __init__(self, handle: ModelHandle, executor: Executor | str = "cpu", capacity: int = 512,
                 mmproj: str | Path | None = None, pan_and_scan: bool = False, weights: Any = None) -> None:
        """`handle` a vision-language checkpoint, or with `mmproj` (llama.cpp's vision GGUF) its text GGUF.
        pan_and_scan: Gemma 3's crops of very wide or tall images, as Gemma3Processor(do_pan_and_scan=True).
        weights: the checkpoint's weights already on `executor` (a Driver's, so a serving driver and this
        runtime hold one copy); uploaded here when None."""
        self.handle = handle
        if mmproj is not None:
            from poot_family_vision.mmproj import open_pair

            self.config, store, self.kind = open_pair(handle, mmproj, pan_and_scan)
        else:
            self.config, store = handle.config(), handle.store()
        if not isinstance(self.config.params, VisionLanguageParams):
            raise RequestError(f"{self.config.architecture} takes no images")
        self.params: VisionLanguageParams = self.config.params
        self.executor = open_executor(executor) if isinstance(executor, str) else executor
        self.capacity = min(capacity, self.config.max_positions)
        self.weights = self.executor.upload(store) if weights is None else weights
        self._shapes = store.shapes()
        # one KV state and one decode step for every request: a decode step replayed as a captured graph (the
        # Triton executor) stays captured across requests; a prefill writes from position 0 and no step reads
        # a position its request has not written
        self._state: Any = None
        self._no_state: dict[str, Any] = {}  # the vision tower has no state; the same empty one every run
        self._programs: OrderedDict[tuple[Any, ...], tuple[Any, Any]] = OrderedDict()  # see _program
        if mmproj is None:
            self.kind = images_of(handle, self.params, pan_and_scan)

    @classmethod
    def load(cls, path: str | Path, executor: Executor | str = "cpu", capacity: int = 512,
             mmproj: str | Path | None = None, pan_and_scan: bool = False) -> VisionLanguageModel:
        return cls(ModelHandle.load(path), executor, capacity, mmproj, pan_and_scan)

    def _program(self, shape: StepShape, trace, key: tuple[Any, ...]) -> tuple[Any, Any]:
        """(the prepared program, its graph) of `trace` at `shape`; `key` names everything else the trace depends
        on. The last PROGRAMS are kept (preparing one for the GPU takes much longer than running it)."""
        full = (shape, *key)
        kept = self._programs.get(full)
        if kept is not None:
            self._programs.move_to_end(full)
            return kept
        t = Tracer(shape, self._shapes)
        trace(t)
        kept = self._programs[full] = (self.executor.prepare(t.graph, self.weights), t.graph)
        while len(self._programs) > PROGRAMS:
            self._programs.popitem(last=False)
        return kept

    # --- images ---------------------------------------------------------------------------------------
    def frames(self, images: Sequence[object]) -> tuple[np.ndarray, list[Any]]:
        """float32 [frames, 3, S, S] of all the images in order, as transformers' processor computes them, and
        each image's layout (Idefics3: its (rows, cols) of tiles; Gemma 3: its number of crops); Qwen2.5-VL:
        the patches [L, 3 * 2 * 14 * 14] and each image's grid (1, h, w)."""
        done = [self.kind.frames(load_image(i)) for i in images]  # type: ignore[arg-type]
        return np.concatenate([np.stack(f) for f, _ in done]), [g for _, g in done]

    def pixel_values(self, images: Sequence[object]) -> np.ndarray:
        return self.frames(images)[0]

    def encode_images(self, pixels: np.ndarray, layouts: Sequence[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(the tower's last hidden state, the image features [.., Dt]): Idefics3 / Gemma 3 [N, P, Dv] and
        [N, tokens per image, Dt] of frames [N, 3, S, S]; Qwen2.5-VL [1, L, Dv] in window order and [L / 4, Dt]
        of patches [L, 1176] with each image's grid (t, h, w) in `layouts`."""
        shape, trace, inputs, key = self.kind.vision_step(pixels, layouts)
        prog, _ = self._program(shape, trace, ("vision", *key))
        hidden, features = prog.run(self._no_state, inputs)  # one object: a captured tower replays
        return self.executor.to_numpy(hidden), self.executor.to_numpy(features)

    # --- text -----------------------------------------------------------------------------------------
    def _image_rows(self, tokens: list[int], features: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        at = np.flatnonzero(np.asarray(tokens) == self.params.image_token_id).astype(np.int64)
        flat = np.zeros((0, self.config.hidden_size), np.float32) if features is None else \
            features.reshape(-1, features.shape[-1]).astype(np.float32)
        if len(at) != len(flat):
            raise RequestError(f"the prompt has {len(at)} image tokens for {len(flat)} image features")
        return at, flat

    def _prefill(self, tokens: list[int], features: np.ndarray | None, all_logits: bool,
                 layouts: Sequence[Any] | None = None) -> tuple[object, object, int]:
        """(the step's logits, the KV state, the offset of later tokens' rope positions)."""
        if not tokens or len(tokens) > self.capacity:
            raise RequestError(f"a prompt of {len(tokens)} tokens does not fit the capacity of {self.capacity}")
        image_id = self.params.image_token_id
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size and t != image_id]
        if bad:
            raise RequestError(f"token ids outside the vocabulary of {self.config.vocab_size}: {bad[:5]}")
        at, flat = self._image_rows(tokens, features)
        groups = bool(len(at)) and self.kind.bidirectional
        # replayed: the one state, always from position 0; an executor may capture it (the same image size and
        # prompt length then replay)
        shape = StepShape(1, len(tokens), self.capacity, all_logits=all_logits, replayed=True, embedded=len(at))
        mrope = self.kind.mrope
        prog, graph = self._program(shape, lambda t: trace_text(self.config, t, len(at), groups, mrope),
                                    ("text", len(at), groups, mrope))
        if self._state is None:
            self._state = self.executor.allocate_state(graph)
        state = self._state
        # an image token outside the vocabulary embeds as 0 before its features replace it (as transformers does)
        ids = [0 if t == image_id and t >= self.config.vocab_size else t for t in tokens]
        inputs = {"tokens": np.asarray([ids], np.int64), "positions": np.arange(len(tokens))[None, :]}
        if len(at):
            inputs |= {EMBED_VALUES: flat, EMBED_ROWS: at}
        if groups:
            inputs["groups"] = image_groups(tokens, image_id)
        extra, delta = self.kind.prompt_inputs(tokens, layouts)
        return prog.run(state, inputs | extra)[0], state, delta

    def logits(self, tokens: list[int], images: Sequence[object] = (), pixels: np.ndarray | None = None,
               layouts: Sequence[Any] | None = None) -> np.ndarray:
        """float32 [positions, vocab]: the logits after every position of the prompt (`pixels` with their
        `layouts`, Qwen2.5-VL's grids, instead of `images`)."""
        features, layouts = self._features(images, pixels, layouts)
        out, _, _ = self._prefill(tokens, features, True, layouts)
        return self.executor.to_numpy(out)[0]

    def _features(self, images: Sequence[object], pixels: np.ndarray | None,
                  layouts: Sequence[Any] | None) -> tuple[np.ndarray | None, Sequence[Any] | None]:
        if pixels is None and images:
            pixels, layouts = self.frames(images)
        return (None if pixels is None else self.encode_images(pixels, layouts)[1]), layouts

    def request(self, tokens: list[int], images: Sequence[object] = (), **fields: Any) -> GenerateRequest:
        """A request for the serving engine (Driver.serve(Layout.PAGED)) of this checkpoint: the prompt with the
        images' features, computed here and now by the vision tower, as the embeddings of its image tokens.
        `fields`: GenerateRequest's others (max_new, sampler, stops, ...). Families whose image tokens need more
        than their embeddings and rope positions are refused at submit."""
        return GenerateRequest(list(tokens), embeddings=self.embeddings(tokens, list(images)), **fields)

    def render(self, text: Any, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> tuple[Any, list[Image.Image]]:
        """(the rendered chat, each image's placeholder expanded to its image tokens, and the images) of a chat
        whose messages may hold image parts (see messages.py); `text` the checkpoint's TextServices."""
        plain, images = split_images(messages)
        texts = [self.kind.text(self.kind.frames(i)[1]) for i in images]
        return expand_images(text.render_chat_value(plain, tools), self.kind.placeholder, texts), images

    def embeddings(self, prompt: list[int], images: list[Any]) -> PromptEmbeddings | None:
        """The images' features as the embeddings of the prompt's image tokens, with the prompt's rope positions
        by section where the model ropes so (Qwen2.5-VL's M-RoPE); None without images."""
        features, layouts = self._features(images, None, None)
        at, flat = self._image_rows(list(prompt), features)
        if not len(at):
            return None
        positions, offset = self.kind.rope_positions(list(prompt), layouts)
        return PromptEmbeddings(at, flat, positions, offset)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[Image.Image]]:
        """(prompt ids, images) of a chat whose messages may hold image parts (see messages.py)."""
        text = self.handle.text()
        rendered, images = self.render(text, messages)
        return text.encode_chat(rendered), images

    def chat(self, messages: list[dict[str, Any]], max_new: int = 32) -> tuple[list[int], str]:
        """Greedy reply to a chat with images: (token ids, text)."""
        tokens, images = self.chat_prompt(messages)
        ids = self.generate(tokens, images, max_new)
        return ids, self.handle.text().decode(ids, skip_special=True)

    def generate(self, tokens: list[int], images: Sequence[object] = (), max_new: int = 32,
                 pixels: np.ndarray | None = None, ignore_eos: bool = False,
                 layouts: Sequence[Any] | None = None, on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy continuation of the prompt; `on_token` is called with each new token as it is chosen."""
        features, layouts = self._features(images, pixels, layouts)
        out, state, delta = self._prefill(tokens, features, False, layouts)
        mrope = self.kind.mrope
        step, _ = self._program(StepShape(1, 1, self.capacity), lambda t: trace_text(self.config, t, mrope=mrope),
                                ("text", 0, False, mrope))
        new: list[int] = []
        position = len(tokens)
        pick = device_greedy(self.executor) or (lambda o: int(np.argmax(self.executor.to_numpy(o)[0, -1])))
        while len(new) < max_new and position < self.capacity:
            token = pick(out)  # on the device where the executor can: one id crosses, not the logits
            new.append(token)
            if on_token is not None:
                on_token(token)
            if token in self.config.eos_ids and not ignore_eos:
                break
            out = step.run(state, {"tokens": np.asarray([[token]], np.int64),
                                   "positions": np.asarray([[position]], np.int64)}
                           | self.kind.step_inputs(position, delta))[0]
            position += 1
        return new
