"""The CLI as a user runs it: a separate process on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_generate_chat_answers(embedded_dir):
    proc = run_cli("generate", "--chat", "What is the capital of France?", "--max-tokens", "32", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France is Paris."
    assert "num_free_blocks" in proc.stderr


def test_generate_plain_prompt_with_model_path(embedded_dir):
    proc = run_cli("generate", "The capital of France is", "--max-tokens", "5", "--model", str(embedded_dir))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_bad_argument_is_a_clear_error(embedded_dir):
    proc = run_cli("generate", "hi", "--temperature", "-1")
    assert proc.returncode == 2 and "temperature" in proc.stderr


def test_gpus_per_worker_reaches_the_engine_settings(embedded_dir):
    proc = run_cli("generate", "hi", "--device", "cpu", "--executor", "ray", "--tp", "3", "--gpus-per-worker", "0.5")
    assert proc.returncode == 2 and "gpus_per_worker=0.5 has no meaning with device='cpu'" in proc.stderr


def test_speculative_decoding_from_the_command_line(embedded_dir):
    """Greedy text with n-gram speculation is the text without it; the counts show it verified proposals."""
    prompt = "Repeat after me: one two three four five, one two three four five, one two three"
    plain = run_cli("generate", prompt, "--max-tokens", "24")
    spec = run_cli("generate", prompt, "--max-tokens", "24", "--stats", "--speculative-config",
                   '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}')
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "'spec_num_rows'" in spec.stderr
    bad = run_cli("generate", "hi", "--speculative-config", '{"method": "ngram"}')
    assert bad.returncode == 2 and "speculative_config.num_speculative_tokens=None" in bad.stderr
    bad = run_cli("generate", "hi", "--speculative-config", "ngram")
    assert bad.returncode == 2 and "--speculative-config: not JSON" in bad.stderr


def test_a_lora_adapter_from_the_command_line(embedded_dir, tmp_path):
    """--lora runs the prompt with a PEFT adapter of the embedded model: PEFT's greedy text; a broken one is refused
    by name."""
    import torch
    import transformers
    from peft import PeftModel

    from .test_lora import make_adapter

    base = transformers.AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    make_adapter(base, tmp_path / "adapter", 4, 8, False, ["q_proj", "v_proj", "down_proj"], seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(embedded_dir)
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        out = peft.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    proc = run_cli("generate", prompt, "--max-tokens", "8", "--lora", str(tmp_path / "adapter"),
                   "--max-lora-rank", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) + "\n"
    bad = run_cli("generate", prompt, "--lora", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "missing' is not a directory" in bad.stderr
