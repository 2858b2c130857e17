"""Exercise a running vLLM server (port 8011): health, token-in completion with logprobs,
throughput, dev/RL endpoints. usage: client_tests.py <model_dir> [section...]"""
import json, sys, time, urllib.request

BASE = "http://127.0.0.1:8011"
MODEL = sys.argv[1]
SECTIONS = set(sys.argv[2:]) or {"basic", "tput", "rl"}

def call(method, path, body=None, timeout=300):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method, headers={"Content-Type": "application/json"})
    t = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            txt = r.read().decode(); code = r.status
    except urllib.error.HTTPError as e:
        txt = e.read().decode(); code = e.code
    try: out = json.loads(txt)
    except Exception: out = txt
    print(f"\n### {method} {path} {json.dumps(body)[:300] if body else ''}\n-> HTTP {code} in {time.time()-t:.3f}s: {json.dumps(out)[:1500] if not isinstance(out, str) else out[:1500]}")
    return code, out

def completion(prompt_ids, max_tokens=8, seed=0, **kw):
    body = dict(model=MODEL, prompt=prompt_ids, max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=1,
                return_tokens_as_token_ids=True, return_token_ids=True, ignore_eos=True)
    body.update(kw)
    return call("POST", "/v1/completions", body)

if "basic" in SECTIONS:
    call("GET", "/health"); call("GET", "/v1/models"); call("GET", "/version")
    code, out = completion([5, 17, 33, 99, 250], max_tokens=6, prompt_logprobs=0)
    if code == 200:
        ch = out["choices"][0]
        print("\nSUMMARY token_ids:", ch.get("token_ids"), "\n prompt_token_ids:", ch.get("prompt_token_ids"),
              "\n logprobs.tokens:", ch["logprobs"]["tokens"], "\n token_logprobs:", ch["logprobs"]["token_logprobs"],
              "\n prompt_logprobs:", json.dumps(ch.get("prompt_logprobs"))[:400])
    call("POST", "/v1/completions", dict(model=MODEL, prompt="the quick brown fox", max_tokens=4, temperature=0, logprobs=2))

if "tput" in SECTIONS:
    for n, mt in [(1, 128), (8, 128)]:
        import concurrent.futures as cf
        t = time.time()
        with cf.ThreadPoolExecutor(n) as ex:
            outs = list(ex.map(lambda i: completion([5 + i, 17, 33, 99], max_tokens=mt, seed=i), range(n)))
        dt = time.time() - t
        ntok = sum(o[1]["usage"]["completion_tokens"] for o in outs if o[0] == 200)
        print(f"\nTHROUGHPUT concurrency={n} max_tokens={mt}: {ntok} tokens in {dt:.2f}s = {ntok/dt:.1f} tok/s")

if "rl" in SECTIONS:
    call("GET", "/is_sleeping"); call("POST", "/sleep?level=1"); call("GET", "/is_sleeping"); call("POST", "/wake_up")
    call("GET", "/is_paused"); call("POST", "/pause?mode=abort"); call("GET", "/is_paused"); call("POST", "/resume"); call("GET", "/is_paused")
    call("GET", "/weight_info"); call("GET", "/get_world_size")
    call("GET", "/server_info")
