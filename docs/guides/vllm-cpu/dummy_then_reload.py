"""Server started with --load-format dummy (random weights, no checkpoint read). Check the RL weight-transfer
endpoints without an engine, then load real weights with collective_rpc reload_weights(weights_path=...) and
verify parity with transformers. usage: dummy_then_reload.py <model_dir>"""
import json, sys, urllib.request, torch
from transformers import AutoModelForCausalLM
D = sys.argv[1]; PROMPT = [5, 17, 33, 99, 250, 7]
def call(method, path, body=None):
    req = urllib.request.Request("http://127.0.0.1:8011" + path, data=None if body is None else json.dumps(body).encode(),
                                 method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r: code, txt = r.status, r.read().decode()
    except urllib.error.HTTPError as e: code, txt = e.code, e.read().decode()
    print(f"### {method} {path} {json.dumps(body) if body else ''}\n-> HTTP {code}: {txt[:600]}"); return code, txt
def check(tag):
    _, txt = call("POST", "/v1/completions", dict(model=D, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                  return_token_ids=True, ignore_eos=True))
    ch = json.loads(txt)["choices"][0]; ids, lps = ch["token_ids"], ch["logprobs"]["token_logprobs"]
    m = AutoModelForCausalLM.from_pretrained(D, dtype=torch.float32).eval()
    with torch.no_grad(): lp = torch.log_softmax(m(torch.tensor([PROMPT + ids])).logits[0], -1)
    print(f"[{tag}] max|vllm-hf logprob| = {max(abs(a - lp[len(PROMPT)-1+i, t].item()) for i, (a, t) in enumerate(zip(lps, ids))):.2e}")
check("dummy weights")
call("POST", "/start_weight_update"); call("POST", "/update_weights", {"update_info": {}})
call("POST", "/init_weight_transfer_engine", {"init_info": {"backend": "ipc"}})
call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": D}})
call("POST", "/reset_prefix_cache")
check("after reload_weights(weights_path=model_dir)")
