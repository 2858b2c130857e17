#!/bin/bash
# usage: serve.sh <model_dir> <logfile> [extra vllm args...]
# Starts the vLLM OpenAI server at low priority on port 8011, dev-mode endpoints on.
MODEL=$1; LOG=$2; shift 2
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CACHE_ROOT=/tmp/vllm-study/cache VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
cd /tmp/vllm-study
date +%s.%N > $LOG.start
exec nice -n 19 venv/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype float32 \
  --max-model-len 256 --max-num-seqs 8 --port 8011 --host 127.0.0.1 "$@" > $LOG 2>&1
