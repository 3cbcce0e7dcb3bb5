#!/usr/bin/env bash
# The project's runtime wheels that the GPU image and gpu-stage's vLLM set lack (what the
# gateway, the pool, scoring, the trainer and benchmarks/learning import), for Python 3.12:
#
#   benchmarks/gpu/wheels.sh /tmp/extra && ../shared/tools/gpu-bundle /tmp/bundle \
#     && rm /tmp/bundle/{jsonschema,jsonschema_specifications,referencing,rpds_py,importlib_metadata}-*.whl \
#     && GPU_STAGE_CHUNK_MIB=28 ../shared/tools/gpu-stage .dev-NAME/stage /tmp/extra /tmp/bundle
#
# (28 MiB chunks: each staging call carries the tracked tree too, 34 MB now (`git ls-files -z | xargs -0
# du -cb | tail -1`), and a call carries at most 64 MiB; 32 MiB chunks stopped fitting beside it.)
#
# gpu-bundle (veRL 0.9.1 + Ray: trainer.objectives imports veRL's core_algos) also ships
# importlib_metadata 10.2, which on Python 3.12 imports `lazy_importer` (not carried): the import
# of benchmarks/learning failed with it on the H100, so it is replaced by 8.7.0 here (LiteLLM
# wants < 9). The jsonschema family is already in gpu-stage's set.
set -euo pipefail
out=${1:?usage: wheels.sh OUTDIR}
mkdir -p "$out"
plat=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform any --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
for p in litellm==1.110.2 fastuuid==0.14.0 sqlalchemy==2.1.9 greenlet==3.5.6 alembic==1.20.1 mako==1.4.3 \
  pydantic-settings celery==5.7.0 kombu==5.7.0 billiard vine amqp click-didyoumean click-repl click-plugins \
  prompt_toolkit wcwidth tzlocal==5.4.5 tzdata redis==8.1.0 itsdangerous==2.2.0 h2 hpack hyperframe \
  importlib_metadata==8.7.0 nh3 markdown-it-py mdurl detect-secrets==1.5.0 orjson liger-kernel==0.8.5; do
  python3 -m pip download -q "${plat[@]}" -d "$out" "$p" 2>&1 | grep -v '^WARNING: Location' || true
done
ls "$out" | wc -l
