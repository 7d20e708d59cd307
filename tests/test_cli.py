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
