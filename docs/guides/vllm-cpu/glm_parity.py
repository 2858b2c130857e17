"""Compare vLLM (serving tiny-dsv3-dense = GLM weights, dense MLA) with transformers' GlmMoeDsaForCausalLM on
tiny-glm-dsa (same weights + indexer, index_topk=16). Short context (<= index_topk) should match exactly;
longer contexts diverge because the DSA indexer then drops keys. usage: glm_parity.py <served_dir> <glm_dir>"""
import json, sys, urllib.request, torch
from transformers import AutoModelForCausalLM
served, glm = sys.argv[1], sys.argv[2]
hf_glm = AutoModelForCausalLM.from_pretrained(glm, dtype=torch.float32).eval()
hf_dsv3 = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32).eval()
print(type(hf_glm).__name__, type(hf_dsv3).__name__)
for plen, gen in [(6, 8), (40, 8)]:
    prompt = [(7 * i + 5) % 1000 + 4 for i in range(plen)]
    body = dict(model=served, prompt=prompt, max_tokens=gen, temperature=0, logprobs=0, return_token_ids=True, ignore_eos=True)
    r = json.loads(urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8011/v1/completions",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}), timeout=600).read())
    ch = r["choices"][0]; ids, lps = ch["token_ids"], ch["logprobs"]["token_logprobs"]
    x = torch.tensor([prompt + ids])
    for name, m in [("hf GlmMoeDsa (DSA, topk=16)", hf_glm), ("hf DeepseekV3 (dense MLA)", hf_dsv3)]:
        with torch.no_grad(): lp = torch.log_softmax(m(x).logits[0].float(), -1)
        ref = [lp[plen - 1 + i, t].item() for i, t in enumerate(ids)]
        greedy = [int(lp[plen - 1 + i].argmax()) for i in range(gen)]
        print(f"prompt_len={plen} total_len={plen+gen} vs {name}: max|dlogprob|={max(abs(a-b) for a,b in zip(lps, ref)):.2e} "
              f"greedy_match={greedy == ids}")
