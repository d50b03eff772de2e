#!/usr/bin/env bash
# Downloads, into .whl/, the wheels a GPU machine without internet needs beyond a CUDA image that already
# holds torch, triton, transformers, numpy, pytest, httpx, anyio and their kin: the GGUF reader, structured
# output, the server and its clients, and the Vulkan/OpenCL bindings. Install them there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  -d .whl \
  gguf 'llguidance>=1.9.1,<2' jsonschema jsonschema-specifications referencing rpds-py \
  fastapi opentelemetry-api starlette pydantic pydantic-core annotated-types typing-inspection uvicorn httptools prometheus-client \
  openai distro jiter \
  wgpu cffi pycparser rendercanvas pyopencl pytools platformdirs siphash24
ls .whl
