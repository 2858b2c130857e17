"""Isolate the vLLM-vs-transformers logprob gap on the tiny MLA+MoE model by zeroing parts of the weights,
hot-reloading them (collective_rpc reload_weights) and re-running mla_precision.py. Restores the file at the end."""
import json, shutil, subprocess, sys, urllib.request
from pathlib import Path
from safetensors.torch import load_file, save_file
d = Path(sys.argv[1]); f = d / "model.safetensors"; shutil.copy(f, d / "orig.bak")
def post(p, b=None):
    return urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8011" + p, data=json.dumps(b or {}).encode(),
        headers={"Content-Type": "application/json"}), timeout=600).read().decode()
variants = {
    "no_moe_layer1 (routed+shared experts down_proj=0)": lambda k: ".layers.1.mlp." in k and "down_proj" in k,
    "no_attention (o_proj=0 all layers)": lambda k: "o_proj" in k,
    "no_attention_no_moe": lambda k: "o_proj" in k or (".layers.1.mlp." in k and "down_proj" in k),
}
try:
    for name, pred in variants.items():
        sd = load_file(d / "orig.bak")
        save_file({k: (v * 0 if pred(k) else v) for k, v in sd.items()}, f, metadata={"format": "pt"})
        post("/collective_rpc", {"method": "reload_weights"}); post("/reset_prefix_cache")
        out = subprocess.run([sys.executable, str(Path(__file__).parent / "mla_precision.py"), str(d)], capture_output=True, text=True).stdout
        print(f"== {name}\n{out}")
finally:
    shutil.copy(d / "orig.bak", f); (d / "orig.bak").unlink()
    post("/collective_rpc", {"method": "reload_weights"}); post("/reset_prefix_cache")
