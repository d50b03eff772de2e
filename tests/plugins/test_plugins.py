"""Plugin discovery: families and backends from entry points, broken plugins, explicit loading,
conflicting claims, and a third-party family installed with pip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import poot_core
from poot_core import Family, PluginError, Reason, Registry, Unsupported, open_executor
from poot_core.executor import BackendSpec
from poot_core.plugins import discover

PUBLIC = ["ModelHandle", "LoadOptions", "Registry", "open_executor", "BackendChoice", "Driver", "DriverOptions",
          "Layout", "GenerateRequest", "Sampler", "GenerationControl"]


def test_public_api_importable_from_package():
    for name in PUBLIC:
        assert hasattr(poot_core, name), name
    from poot_core.errors import (  # noqa: F401
        CapacityError,
        CheckpointError,
        IntegrityError,
        PootError,
        RequestError,
        TemplateError,
        Unsupported,
    )


def test_builtin_registry_holds_installed_families():
    names = {f.name for f in Registry.builtin().families()}
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3"} <= names


def test_unknown_architecture_is_typed_refusal_naming_families():
    with pytest.raises(Unsupported) as err:
        Registry.builtin().resolve("NoSuchForCausalLM")
    assert err.value.reason is Reason.REGISTRY
    assert "NoSuchForCausalLM" in str(err.value) and "llama" in str(err.value)


def test_two_families_claiming_one_architecture_is_an_error():
    class A(Family):
        name, architectures = "a", ("SharedArch",)

        def trace(self, config, t, shape):
            pass

    class B(A):
        name = "b"

    with pytest.raises(PluginError) as err:
        Registry([("dist-a", A()), ("dist-b", B())])
    assert "dist-a" in str(err.value) and "dist-b" in str(err.value)


def test_auto_selection_order_and_absent_backend_refusal():
    opened = []

    def spec(name, present, priority):
        return BackendSpec(name, lambda: opened.append(name) or name, lambda: present, priority)

    backends = [spec("cpu", True, 0), spec("vulkan", True, 20), spec("cuda", False, 40), spec("rocm", False, 30)]
    assert open_executor("auto", backends) == "vulkan"
    with pytest.raises(Unsupported) as err:
        open_executor("cuda", backends)
    assert err.value.reason is Reason.BACKEND and err.value.name == "cuda"
    with pytest.raises(Unsupported):
        open_executor("nosuch", backends)


def test_cpu_backend_is_found_through_its_entry_point():
    assert open_executor("cpu").name == "cpu"


def _poot(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "poot_core.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_disable_autoload_with_explicit_list():
    env = {"POOT_DISABLE_PLUGIN_AUTOLOAD": "1", "POOT_PLUGINS": "cpu"}
    out = _poot("plugins", "--json", env=env)
    assert out.returncode == 0, out.stderr
    names = {r["name"] for r in json.loads(out.stdout)}
    assert names == {"cpu"}


def _write_distribution(root: Path, name: str, module_body: str, group: str = "poot.families") -> Path:
    pkg = name.replace("-", "_")
    (root / pkg).mkdir(parents=True)
    (root / pkg / "__init__.py").write_text(textwrap.dedent(module_body))
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "0.0.1"
        dependencies = []
        [project.entry-points."{group}"]
        {pkg} = "{pkg}"
        [tool.setuptools]
        packages = ["{pkg}"]
    """))
    return root


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, timeout=600,
                   env={**os.environ, "PIP_NO_BUILD_ISOLATION": "1"})


THIRD_PARTY = """
    from poot_core import Family, hookimpl
    from poot_family_llama.plugin import DenseDecoder

    class ThirdPartyLlama(DenseDecoder):
        def __init__(self):
            super().__init__("third_party", "llama", ("ThirdPartyForCausalLM",))

    @hookimpl
    def poot_register_families():
        return [ThirdPartyLlama()]
"""

BROKEN = """
    raise RuntimeError("this plugin is broken on purpose")
"""


@pytest.mark.slow
def test_third_party_family_install_load_uninstall(tmp_path, tiny_checkpoint):
    """A third party publishes a family as its own distribution: pip install it, poot sees it and loads a
    checkpoint through it; pip uninstall it, and the same checkpoint is a typed refusal. A broken plugin
    installed beside it is listed with its error and does not break the others."""
    ckpt = tmp_path / "ckpt"
    src = tiny_checkpoint("llama", torch.float32)
    ckpt.mkdir()
    for f in src.iterdir():
        (ckpt / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["ThirdPartyForCausalLM"]
    config["model_type"] = "third_party_llama"
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").write_text(json.dumps(config))

    good = _write_distribution(tmp_path / "good", "poot-test-third-party", THIRD_PARTY)
    bad = _write_distribution(tmp_path / "bad", "poot-test-broken", BROKEN)
    _pip("install", "--no-deps", str(good), str(bad))
    try:
        listing = _poot("plugins")
        assert listing.returncode == 0, listing.stderr
        assert "poot-test-third-party" in listing.stdout and "ThirdPartyForCausalLM" in listing.stdout
        assert "poot-test-broken" in listing.stdout and "broken on purpose" in listing.stdout
        assert "poot-family-llama" in listing.stdout  # the others still load
        check = ("from poot_core import ModelHandle, Registry; "
                 f"h = ModelHandle.load({str(ckpt)!r}, Registry.builtin()); print(h.family.name)")
        out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "third_party"
    finally:
        _pip("uninstall", "-y", "poot-test-third-party", "poot-test-broken")
    check = ("from poot_core import ModelHandle, Unsupported\n"
             f"try:\n    ModelHandle.load({str(ckpt)!r})\nexcept Unsupported as e:\n    print(e.reason.value)")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "Registry", out.stderr


def test_discovery_records_distribution_and_version():
    records = {r.name: r for r in discover().records}
    assert records["cpu"].distribution == "poot-core"
    assert records["llama"].distribution == "poot-family-llama"
    assert records["llama"].version
