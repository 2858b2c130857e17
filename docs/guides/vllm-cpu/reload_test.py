"""Weight-reload test against a running server (port 8011) serving <model_dir>.
1) token-in greedy completion + logprobs, compare sampled-token logprobs with a transformers forward (parity)
2) overwrite <model_dir>/model.safetensors with new random weights (same names/shapes)
3) POST /collective_rpc {"method": "reload_weights"} (no args: reload from the original model path),
   then /reset_prefix_cache, re-query, compare with transformers on the new weights.
4) also try reload_weights with kwargs {"weights_path": <other dir>}.
usage: reload_test.py <model_dir> <hf_auto_class: llama|auto>"""
import json, shutil, sys, time, urllib.request, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

BASE = "http://127.0.0.1:8011"
D = Path(sys.argv[1])
PROMPT = [5, 17, 33, 99, 250, 7]

def call(method, path, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method, headers={"Content-Type": "application/json"})
    t = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r: txt, code = r.read().decode(), r.status
    except urllib.error.HTTPError as e: txt, code = e.read().decode(), e.code
    try: out = json.loads(txt)
    except Exception: out = txt
    print(f"### {method} {path} {json.dumps(body) if body else ''}\n-> HTTP {code} in {time.time()-t:.3f}s: {str(out)[:800]}")
    return code, out

def gen():
    code, out = call("POST", "/v1/completions", dict(model=str(D), prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                     return_token_ids=True, return_tokens_as_token_ids=True, ignore_eos=True))
    ch = out["choices"][0]
    return ch["token_ids"], ch["logprobs"]["token_logprobs"]

def hf_logprobs(ids_out, path=D):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([PROMPT + ids_out])
    with torch.no_grad(): lp = torch.log_softmax(m(x).logits[0].float(), -1)
    n = len(PROMPT)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(ids_out)], [int(lp[n - 1 + i].argmax()) for i in range(len(ids_out))]

def compare(tag, path=D):
    ids, lps = gen()
    hf, hf_greedy = hf_logprobs(ids, path)
    diff = max(abs(a - b) for a, b in zip(lps, hf))
    print(f"[{tag}] vllm ids {ids}\n[{tag}] hf greedy ids given vllm prefix {hf_greedy} (match={hf_greedy == ids})\n"
          f"[{tag}] vllm lp {[round(v, 5) for v in lps]}\n[{tag}] hf   lp {[round(v, 5) for v in hf]}\n[{tag}] max|dlogprob| = {diff:.2e}")
    return ids, lps

def perturb(dst_file, seed):
    sd = load_file(dst_file)
    g = torch.Generator().manual_seed(seed)
    new = {k: (v + 0.5 * torch.randn(v.shape, generator=g) * v.float().std().clamp_min(0.02)).to(v.dtype)
           if v.dim() > 1 else v for k, v in sd.items()}
    tmp = dst_file.with_suffix(".tmp")
    save_file(new, tmp, metadata={"format": "pt"}); tmp.replace(dst_file)   # atomic rename in the same dir

shutil.copy(D / "model.safetensors", D / "model.safetensors.orig")
ids0, lp0 = compare("original")
perturb(D / "model.safetensors", seed=123)
call("POST", "/collective_rpc", {"method": "reload_weights"})
call("POST", "/reset_prefix_cache")
ids1, lp1 = compare("after in-place file change + reload_weights()")
print("CHANGED vs original:", ids1 != ids0 or lp1 != lp0)

# reload from a different directory via weights_path
D2 = D.parent / (D.name + "-v2")
if D2.exists(): shutil.rmtree(D2)
shutil.copytree(D, D2, ignore=shutil.ignore_patterns("*.orig"))
perturb(D2 / "model.safetensors", seed=456)
call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(D2)}})
call("POST", "/reset_prefix_cache")
ids2, lp2 = compare("after reload_weights(weights_path=v2)", path=D2)
# restore original file
shutil.copy(D / "model.safetensors.orig", D / "model.safetensors")
