"""The long-context suite: deterministic, unambiguous, the right length, real filler, strict
exact-match scoring (through the real generate loop), and train/eval separation."""

import re
from types import SimpleNamespace

import pytest
import torch

from data_processing.tokenizer import EOS
from evals.long_context import (TASKS, Example, baseline_configs, evaluate, exact_match, filler_sentences,
                                generate_suite, is_eval_key, key_value_documents, training_documents)
from model.config import preset
from model.model import GLMModel

LENGTHS = (256, 512, 1024)


@pytest.fixture(scope="module")
def suite(tokenizer, shakespeare):
    return generate_suite(tokenizer, LENGTHS, 3, seed=7, filler_texts=[shakespeare])


def test_deterministic_for_a_seed(tokenizer, shakespeare, suite):
    again = generate_suite(tokenizer, LENGTHS, 3, seed=7, filler_texts=[shakespeare])
    assert again == suite
    other = generate_suite(tokenizer, LENGTHS, 3, seed=8, filler_texts=[shakespeare])
    assert [e.prompt for e in other] != [e.prompt for e in suite]
    assert {(e.task, e.length) for e in suite} == {(t, n) for t in TASKS for n in LENGTHS}
    assert len(suite) == len(TASKS) * len(LENGTHS) * 3


def test_answers_are_unambiguous(suite):
    for ex in suite:
        assert re.fullmatch(r"What .+\? Answer: .+ (is|are)", ex.prompt.rsplit("\n", 1)[1])
        values = ex.answer.split(", ")
        assert len(values) == (3 if ex.task == "multi_value" else 1)
        for v in values:
            # exactly once, and not as part of a longer number
            assert len(re.findall(rf"(?<!\d){v}(?!\d)", ex.prompt)) == 1, (ex.task, v)
        question = ex.prompt.rsplit("\n", 1)[1]
        asked = re.search(r"(?:key|VAR) (\w+)\?", question).group(1)
        if ex.task in ("single_key", "multi_key"):
            haystack = ex.prompt.rsplit("\n", 1)[0]
            assert haystack.count(f"key {asked} is {ex.answer}.") == 1
            assert haystack.count(f"key {asked} ") == 1          # no other needle for that key
        if ex.task == "multi_key":
            assert len(re.findall(r"The value of key \w+ is \d+\.", ex.prompt)) == 4
        if ex.task == "multi_value":
            found = re.findall(rf"The value of key {asked} is (\d+)\.", ex.prompt)
            assert ", ".join(found) == ex.answer                     # order of appearance
        if ex.task == "variable_tracking":
            # follow the chain back from the asked variable to its value
            name = asked
            while (m := re.search(rf"VAR {name} = VAR (\w+)\.", ex.prompt)):
                name = m.group(1)
            assert re.search(rf"VAR {name} = (\d+)\.", ex.prompt).group(1) == ex.answer
            assert len(re.findall(r"VAR \w+ = \d+\.", ex.prompt)) == 2   # a distractor chain too


def test_lengths_within_five_percent(tokenizer, suite):
    for ex in suite:
        n = len(tokenizer.encode(ex.prompt).ids)
        assert n == ex.n_tokens
        assert ex.length * 0.95 <= n <= ex.length, (ex.task, ex.length, n)


def test_odd_lengths_within_five_percent(tokenizer, shakespeare):
    examples = generate_suite(tokenizer, [160, 199, 300, 777], 8, seed=3, filler_texts=[shakespeare],
                              tasks=("single_key", "multi_key"))
    for ex in examples:
        assert ex.n_tokens == len(tokenizer.encode(ex.prompt).ids)
        assert ex.length * 0.95 <= ex.n_tokens <= ex.length, (ex.task, ex.length, ex.n_tokens)


def test_filler_is_corpus_text(suite, shakespeare):
    corpus_words = set(" ".join(filler_sentences([shakespeare])).split())
    for ex in suite:
        haystack = ex.prompt.rsplit("\n", 1)[0]
        haystack = re.sub(r"The value of key \w+ is \d+\.|VAR \w+ = (?:VAR \w+|\d+)\.", " ", haystack)
        words = haystack.split()
        assert len(words) >= 40                                     # a real haystack around the needles
        assert all(w in corpus_words for w in words[:-1])           # the last word may be cut short
    assert not any(re.search(r"\d", s) for s in filler_sentences([shakespeare]))


def test_train_and_eval_never_share_keys(tokenizer, shakespeare, suite):
    docs = training_documents(tokenizer, LENGTHS, 3, seed=7, filler_texts=[shakespeare])
    assert len(docs) == len(suite)
    eval_keys = {k.lower() for ex in suite for k in ex.keys}
    assert eval_keys and all(is_eval_key(k) for k in eval_keys)
    train_keys = set()
    for d in docs:
        assert re.search(r"Answer: .+ (is|are) [\d, ]+$", d.text)
        train_keys |= {k.lower() for k in re.findall(r"(?:key|VAR) (\w+)", d.text)}
    assert train_keys and not any(is_eval_key(k) for k in train_keys)
    assert not eval_keys & train_keys
    eval_prompts = {ex.prompt for ex in suite}
    assert not any(d.text.rsplit(" ", 1)[0] in eval_prompts for d in docs)


def test_key_value_documents_ask_every_key_with_its_value():
    docs = key_value_documents(20, seed=3, sizes=(4, 8))
    assert docs == key_value_documents(20, seed=3, sizes=(4, 8))       # deterministic
    for d in docs:
        needles, questions = d.text.split("\n", 1)
        planted = dict(re.findall(r"The value of key (\w+) is (\d+)\.", needles))
        asked = re.findall(r"What is the value of key (\w+)\? Answer: The value of key \1 is (\d+)$", questions, re.M)
        assert len(planted) in (4, 8) and len(asked) == len(planted) == len(questions.split("\n"))
        assert dict(asked) == planted
        assert not any(is_eval_key(k) for k in planted)
    with pytest.raises(ValueError, match="sizes"):
        key_value_documents(1, seed=0, sizes=())


def test_exact_match():
    assert exact_match(" 4821", "4821")
    assert exact_match(" 4821\nThe value", "4821")
    assert exact_match("4821, 17, 3", "4821, 17, 3")
    assert not exact_match(" 482", "4821")
    assert not exact_match(" 48211", "4821")
    assert not exact_match(" 4821 and more", "4821")
    assert not exact_match("\n4821", "4821")
    assert not exact_match("", "4821")


class Scripted(torch.nn.Module):
    """A stand-in model for model.generate: given a prompt, its greedy continuation spells
    replies[prompt] and then <|endoftext|>."""

    def __init__(self, tokenizer, replies: dict[str, str]):
        super().__init__()
        self.tok, self.replies, self.queue = tokenizer, replies, []
        self.V = tokenizer.get_vocab_size()

    def new_cache(self):
        return None

    def forward(self, ids, attention_mask=None, cache=None):
        if ids.shape[1] > 1:                                      # a prompt: start its script
            prompt = self.tok.decode(ids[0].tolist(), skip_special_tokens=False)
            self.queue = self.tok.encode(self.replies[prompt]).ids + [self.tok.token_to_id(EOS)]
        logits = torch.zeros(1, ids.shape[1], self.V)
        logits[0, -1, self.queue.pop(0)] = 1.0
        return SimpleNamespace(logits=logits)


def test_scorer_passes_right_and_fails_wrong_answers(tokenizer, suite):
    examples = [ex for ex in suite if ex.length == 256]
    right = evaluate(Scripted(tokenizer, {ex.prompt: " " + ex.answer for ex in examples}), tokenizer, examples)
    assert right == {**{t: {256: 1.0} for t in TASKS}, "overall": {256: 1.0}}

    wrong_replies = {}
    for i, ex in enumerate(examples):
        wrong_replies[ex.prompt] = [" " + ex.answer[:-1], " " + ex.answer + "7", " " + ex.answer + " and so on"][i % 3]
    wrong = evaluate(Scripted(tokenizer, wrong_replies), tokenizer, examples)
    assert wrong == {**{t: {256: 0.0} for t in TASKS}, "overall": {256: 0.0}}

    # the first example of every task right, the rest wrong: 1/3 each
    mixed = {ex.prompt: (" " + ex.answer + "\n" if i % 3 == 0 else " 1") for i, ex in enumerate(examples)}
    got = evaluate(Scripted(tokenizer, mixed), tokenizer, examples)
    assert got["overall"][256] == pytest.approx(1 / 3)
    assert all(got[t][256] == pytest.approx(1 / 3) for t in TASKS)


class Steered(torch.nn.Module):
    """A real model whose greedy continuation of the prompts in `replies` is forced to spell the
    reply and then <|endoftext|> (a +1e4 logit on the scripted token, through the real forward
    and cache); other prompts get the real model's own continuation."""

    def __init__(self, model, tokenizer, replies: dict[str, str]):
        super().__init__()
        self.model, self.tok, self.replies, self.queue = model, tokenizer, replies, []

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, ids, attention_mask=None, cache=None):
        out = self.model(ids, attention_mask=attention_mask, cache=cache)
        if ids.shape[1] > 1:
            reply = self.replies.get(self.tok.decode(ids[0].tolist(), skip_special_tokens=False))
            self.queue = [] if reply is None else self.tok.encode(reply).ids + [self.tok.token_to_id(EOS)]
        if self.queue:
            out.logits[0, -1, self.queue.pop(0)] += 1e4
        return out


def test_evaluate_runs_a_real_model(tokenizer, suite):
    torch.manual_seed(0)
    cfg = preset("tiny").replace(vocab_size=tokenizer.get_vocab_size(), num_layers=2, mtp_depth=0, index_topk=32)
    model = GLMModel(cfg).eval()
    by_task = {t: [ex for ex in suite if ex.length == 256 and ex.task == t][:2] for t in TASKS}
    examples = [ex for t in TASKS for ex in by_task[t]]
    # steered right: both single_key examples, the first multi_key and multi_value ones (the
    # 3-value answer needs the default budget, answer tokens + 2); the rest is the random-init
    # model's own greedy output (seeded: never the answer)
    steer = by_task["single_key"] + by_task["multi_key"][:1] + by_task["multi_value"][:1]
    replies = {ex.prompt: " " + ex.answer for ex in steer}
    res = evaluate(Steered(model, tokenizer, replies), tokenizer, examples)
    assert res == {"single_key": {256: 1.0}, "multi_key": {256: 0.5}, "multi_value": {256: 0.5},
                   "variable_tracking": {256: 0.0}, "overall": {256: 0.5}}
    # and without steering the same real model answers none
    assert evaluate(model, tokenizer, examples, max_new_tokens=3)["overall"] == {256: 0.0}


def test_baseline_configs_are_like_for_like():
    base = preset("tiny")
    cfgs = baseline_configs(base, [1024, 256, 512], swa_fraction=0.25)
    assert cfgs["full"].layer_kinds == ("full",) * 4
    assert cfgs["dsa"].layer_kinds == ("dsa",) * 4 and not cfgs["dsa"].dense_attention
    assert cfgs["swa"].layer_kinds == ("full", "swa", "full", "swa")
    assert cfgs["swa"].sliding_window == 64
    for c in cfgs.values():
        assert c.replace(attention_pattern=None, sliding_window=base.sliding_window) == base
    with pytest.raises(ValueError, match="index_topk"):
        baseline_configs(base.replace(index_topk=256), [256, 512])


def test_bad_inputs(tokenizer, shakespeare):
    with pytest.raises(ValueError, match="too short"):
        generate_suite(tokenizer, [40], 1, 0, [shakespeare])
    with pytest.raises(ValueError, match="unknown tasks"):
        generate_suite(tokenizer, [256], 1, 0, [shakespeare], tasks=("haystack",))
    with pytest.raises(ValueError, match="usable sentences"):
        generate_suite(tokenizer, [256], 1, 0, ["Too little text. 1234 5678."])
    with pytest.raises(ValueError, match="no examples"):
        evaluate(torch.nn.Linear(1, 1), tokenizer, [])
    assert isinstance(Example("single_key", 1, "p", "a", 1, ("k",)), Example)
