"""MTP speculation (DraftPolicy.Mtp): a tiny DeepSeek V3 checkpoint with one whole nextn layer proposes what a
direct torch computation of the multi-token-prediction formula gives (transformers' own decoder layer on the
same weights), greedy output with it is the plain output token for token, and a checkpoint without (whole)
nextn layers is refused before any tensor is read."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from helpers import moe, tiny
from poot_core import (
    DraftPolicy,
    Driver,
    DriverOptions,
    GenerateRequest,
    ModelHandle,
    Unsupported,
    WeightStore,
    open_executor,
)

OPTIONS = dict(capacity=160, prefill_chunk=16)
REPEATING = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"
PLAIN = [(5 * i + 11) % 240 + 3 for i in range(24)]  # no token twice


def _copying(path: Path, dest: Path) -> Path:
    """The same checkpoint with a nextn layer that proposes its input token again: eh_proj passes the normed
    embedding through, the decoder layer adds nothing (its output projections zero), the head is the embedding.
    The tiny target often repeats a token, so such proposals are kept in runs and rejected where it changes."""
    shutil.copytree(path, dest)
    file = dest / "model.safetensors"
    tensors = load_file(file)
    layers = moe.moe_config("deepseek_v3").num_hidden_layers
    pre = f"model.layers.{layers}."
    d = tensors["model.norm.weight"].shape[0]
    for name in list(tensors):
        if name.startswith(pre) and ("o_proj" in name or "down_proj" in name):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors[pre + "eh_proj.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
    for name in ("enorm", "shared_head.norm"):
        tensors[f"{pre}{name}.weight"] = torch.ones(d)
    tensors[pre + "shared_head.head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """(checkpoint with a whole nextn layer, transformers' target model, the reference decoder layer's model)."""
    path = moe.build(tmp_path_factory.mktemp("v3-mtp"), "deepseek_v3", torch.float32)
    target = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    donor = moe.add_nextn_layer(path, tmp_path_factory.mktemp("v3-donor"))
    return path, target, donor


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Reference:
    """The MTP formula in torch on the checkpoint's tensors: input i = eh_proj([enorm(emb(token i+1)),
    hnorm(hidden i)]), transformers' decoder layer over the inputs (causal, rope at positions 0..), then
    head(shared_head.norm(.)); a further draft token's hidden is the layer's output before that norm."""

    def __init__(self, path: Path, donor: tf.PreTrainedModel) -> None:
        self.w = load_file(path / "model.safetensors")
        config = donor.config
        self.layer = donor.model.layers[config.num_hidden_layers - 1]
        self.rotary = donor.model.rotary_emb
        self.pre = f"model.layers.{config.num_hidden_layers - 1}."
        self.eps = config.rms_norm_eps

    def input(self, token: int, hidden: torch.Tensor) -> torch.Tensor:
        w, pre = self.w, self.pre
        e = _rms(w["model.embed_tokens.weight"][token], w[pre + "enorm.weight"], self.eps)
        h = _rms(hidden, w[pre + "hnorm.weight"], self.eps)
        return torch.cat([e, h]) @ w[pre + "eh_proj.weight"].T

    @torch.no_grad()
    def run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last position's (logits, output hidden) over the inputs at positions 0..len - 1."""
        x = torch.stack(inputs)[None]
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        last = out[0, -1]
        logits = _rms(last, self.w[self.pre + "shared_head.norm.weight"], self.eps) @ self.w[
            self.pre + "shared_head.head.weight"].T
        return logits, last


def test_the_proposal_is_the_mtp_formula_on_the_targets_hidden_states(v3):
    path, target, donor = v3
    handle = ModelHandle.load(path)
    k = 3
    driver = Driver(handle, open_executor("cpu"), DriverOptions(**OPTIONS, draft=DraftPolicy.Mtp(k=k)))
    driver.serve()
    proposer = driver._speculation.proposer
    seen: list[np.ndarray] = []
    run = proposer._run

    def spy(*args):
        logits, hidden = run(*args)
        seen.append(logits)
        return logits, hidden

    proposer._run = spy
    ref = Reference(path, donor)
    for history in (handle.text().encode(REPEATING), PLAIN):
        n = len(history) - 1
        driver.reset()
        driver.prefill_cache(history[:-1])  # the target has run positions 0 .. n - 1, not the last token
        proposer.begin(history[:-1])
        seen.clear()
        proposal = proposer.propose(history, k, None)
        with torch.no_grad():  # the target's final hidden states (after model.norm), from transformers
            hidden = target.model(torch.tensor([history[:-1]])).last_hidden_state[0]
        inputs = [ref.input(history[i + 1], hidden[i]) for i in range(n)]
        want: list[int] = []
        for j in range(k):
            logits, out = ref.run(inputs)
            want.append(int(torch.argmax(logits)))
            np.testing.assert_allclose(seen[-k + j], logits.numpy(), rtol=1e-4, atol=1e-4)
            inputs.append(ref.input(want[-1], out))
        assert proposal.tokens == want


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("layer", ["random", "copying"])
def test_greedy_output_with_mtp_is_the_plain_output(v3, tmp_path, k, layer):
    path = v3[0] if layer == "random" else _copying(v3[0], tmp_path / "copying")
    handle = ModelHandle.load(path)
    ex = open_executor("cpu")
    plain_driver = Driver(handle, ex, DriverOptions(**OPTIONS))
    mtp_driver = Driver(handle, ex, DriverOptions(**OPTIONS, draft=DraftPolicy.Mtp(k=k, min_k=k)))
    proposed = accepted = 0
    for prompt in (handle.text().encode(REPEATING), PLAIN, PLAIN[:5]):  # the last: a follow-up's shared prefix
        request = GenerateRequest(prompt, max_new=40, ignore_eos=True)
        plain = plain_driver.generate(request)
        spec = mtp_driver.generate(request)
        assert (spec.tokens, spec.text, spec.stop_reason) == (plain.tokens, plain.text, plain.stop_reason)
        t = spec.timings
        assert t.verify_steps > 0 and t.proposed >= t.accepted
        proposed, accepted = proposed + t.proposed, accepted + t.accepted
    assert proposed > 0
    if layer == "copying":  # kept runs and rejected (rolled back) tokens on the way
        assert 0 < accepted < proposed
    print(f"{layer} k={k}: {accepted} of {proposed} proposed tokens accepted")


@pytest.fixture
def no_tensor_reads(monkeypatch):
    def refuse(self, name):
        raise AssertionError(f"tensor {name} read before the refusal")

    monkeypatch.setattr(WeightStore, "get", refuse)


def test_mtp_without_nextn_layers_is_refused_before_tensors_are_read(tmp_path, no_tensor_reads):
    dense = tiny.build(tmp_path / "llama", "llama", torch.float32)
    with pytest.raises(Unsupported, match="no multi-token-prediction"):
        Driver(ModelHandle.load(dense), open_executor("cpu"), DriverOptions(**OPTIONS, draft=DraftPolicy.Mtp(k=2)))
    partial = moe.build(tmp_path / "v3", "deepseek_v3", torch.float32)  # nextn norms and eh_proj, no layer
    with pytest.raises(Unsupported, match="lacks the nextn layer's weight"):
        Driver(ModelHandle.load(partial), open_executor("cpu"), DriverOptions(**OPTIONS, draft=DraftPolicy.Mtp(k=2)))
