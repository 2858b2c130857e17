"""Per-position |dlogprob| between vLLM (CPU_MLA) and transformers for prefill (prompt_logprobs, SDPA prefill path)
and decode (sampled-token logprobs, absorbed mla_decode_kvcache path). usage: mla_precision.py <served_dir>"""
import json, sys, urllib.request, torch
from transformers import AutoModelForCausalLM
d = sys.argv[1]
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
prompt = [(7 * i + 5) % 1000 + 4 for i in range(10)]
body = dict(model=d, prompt=prompt, max_tokens=10, temperature=0, logprobs=0, prompt_logprobs=0, return_token_ids=True, ignore_eos=True)
r = json.loads(urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8011/v1/completions",
    data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}), timeout=600).read())
ch = r["choices"][0]; ids = ch["token_ids"]
x = torch.tensor([prompt + ids])
with torch.no_grad(): lp = torch.log_softmax(m(x).logits[0].float(), -1)
pre = [abs(list(ch["prompt_logprobs"][i].values())[0]["logprob"] - lp[i - 1, prompt[i]].item()) for i in range(1, len(prompt))]
dec = [abs(a - lp[len(prompt) - 1 + i, t].item()) for i, (a, t) in enumerate(zip(ch["logprobs"]["token_logprobs"], ids))]
print("prefill |dlp| per pos:", [f"{v:.1e}" for v in pre])
print("decode  |dlp| per pos:", [f"{v:.1e}" for v in dec])
print("hf greedy:", [int(lp[len(prompt) - 1 + i].argmax()) for i in range(len(ids))], "\nvllm ids: ", ids)
