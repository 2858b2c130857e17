"""Tiny random-weight GlmMoeDsaForCausalLM (transformers 5.19 GlmMoeDsaConfig) + variants:
  tiny-glm-dsa        : GlmMoeDsaForCausalLM as glmforge exports it (has index_topk -> DSA sparse attention)
  tiny-dsv3-dense     : same weights minus indexer tensors, config rewritten to DeepseekV3ForCausalLM /
                        model_type deepseek_v3 without index_* keys -> dense MLA (what vLLM CPU_MLA can run)
  tiny-dsv3-dense-r32 : like tiny-dsv3-dense but kv_lora_rank=32 (latent head 32+64=96 != 576)
NOTE: transformers GlmMoeDsa indexer needs index_head_dim >= qk_rope_head_dim (it splits off the rope part).
usage: make_tiny_glm.py <models_root> <tokenizer_src_dir> [kv_lora_rank]"""
import json, shutil, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

root, tok_src = Path(sys.argv[1]), Path(sys.argv[2])

def build(name, kv_lora_rank):
    out = root / name
    if out.exists(): shutil.rmtree(out)
    torch.manual_seed(0)
    L = 2
    cfg = GlmMoeDsaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
        kv_lora_rank=kv_lora_rank, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        max_position_embeddings=512, rms_norm_eps=1e-6, index_topk=16, index_head_dim=64, index_n_heads=2,
        first_k_dense_replace=1, mlp_layer_types=["dense"] + ["sparse"] * (L - 1), indexer_types=["full"] * L,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    cfg.architectures = ["GlmMoeDsaForCausalLM"]
    m = GlmMoeDsaForCausalLM(cfg).float()
    m.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"): shutil.copy(tok_src / f, out / f)
    return out

dsa = build("tiny-glm-dsa", 512)
print("DSA config:", json.load(open(dsa / "config.json"))["architectures"], "index_topk", json.load(open(dsa / "config.json"))["index_topk"])
sd = load_file(dsa / "model.safetensors")
print("num tensors", len(sd), "indexer tensors:", sorted(k for k in sd if "indexer" in k)[:6])

def dense_variant(src, name):
    out = root / name
    if out.exists(): shutil.rmtree(out)
    shutil.copytree(src, out)
    c = json.load(open(out / "config.json"))
    for k in [k for k in c if k.startswith("index") or k in ("indexer_types", "layer_types", "mlp_layer_types")]:
        c.pop(k)
    c.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", topk_method="noaux_tc",
             scoring_func="sigmoid")
    json.dump(c, open(out / "config.json", "w"), indent=1)
    sd = load_file(out / "model.safetensors")
    save_file({k: v for k, v in sd.items() if ".indexer." not in k}, out / "model.safetensors", metadata={"format": "pt"})
    print(name, "config keys:", sorted(c)[:60])

dense_variant(dsa, "tiny-dsv3-dense")
r32 = build("tmp-r32", 32)
dense_variant(r32, "tiny-dsv3-dense-r32"); shutil.rmtree(r32)
