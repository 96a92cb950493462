#!/usr/bin/env bash
# The optional benchmark peers as wheels in .whl/, for a GPU machine that reaches no package index
# (run it here; then run(..., carry=[".whl"]); scripts/gpu_check.sh and scripts/x2_pending.sh install
# them into /tmp/site). PY: the GPU machine's Python (megatron-core 0.19.2 needs 3.12 or newer).
#   bash scripts/peer_wheels.sh            # torchtitan, megatron-core, deepspeed and what they import
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" -d .whl \
  torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
  typing_extensions==4.16.0 megatron-core==0.19.2 \
  einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 psutil==7.2.2 py-cpuinfo==9.0.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
# DeepSpeed is an sdist: built as a pure-Python wheel (Domino needs none of its compiled ops)
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls .whl
