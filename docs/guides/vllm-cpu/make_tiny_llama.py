"""Build a tiny random-weight LlamaForCausalLM + from-scratch BPE tokenizer (no downloads)."""
import sys, json, torch
# NOTE: CPU_ATTN supports head sizes [32, 64, 80, ..., 512] only (vllm/v1/attention/backends/cpu_attn.py:69), so head_dim=32.
from pathlib import Path
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/vllm-study/models/tiny-llama")
out.mkdir(parents=True, exist_ok=True)
V = 1024
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
corpus = [f"the quick brown fox {i} jumps over the lazy dog number {i*7} and counts {i%13}" for i in range(3000)]
trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(corpus, trainer)
print("tokenizer vocab", tok.get_vocab_size())
hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
hf_tok.save_pretrained(out)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  pad_token_id=3, tie_word_embeddings=False, torch_dtype="float32")
m = LlamaForCausalLM(cfg).to(torch.float32)
m.save_pretrained(out, safe_serialization=True)
print(sorted(p.name for p in out.iterdir()))
print(json.load(open(out / "config.json")))
