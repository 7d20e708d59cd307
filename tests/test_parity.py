"""Greedy token ids from LLM.generate equal Hugging Face transformers' greedy generate (fp32, CPU),
including under preemption, prefix-cache hits and chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.scheduler.kv_groups import blocks_held_at_most, kv_groups
from pagedserve.workers.kv_pool import bytes_per_block
from pagedserve.workers.models.model_config import ModelConfig

NEW_TOKENS = 32
BS = 16
# 1, block_size - 1, block_size, block_size + 1 and >= 10 blocks, among others.
PROMPT_LENS = [1, BS - 1, BS, BS + 1, 10 * BS + 7, 40, 5, 2 * BS]

TINY = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v bias
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # q/k RMSNorm, head_dim != hidden / heads
    # Sliding windows, prompts up to 167 tokens past them: one inside a block, on every layer ...
    "mistral-window": ("MistralConfig", {"sliding_window": 12}),
    # ... and one spanning blocks, on the layers from max_window_layers on (the first attends in full).
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1}),
    # Scaled embeddings, residual adds, attention scores and logits.
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                  "attention_multiplier": 0.2, "logits_scaling": 8.0}),
    # Fused q/k/v and gate/up in the checkpoint, and a window on every layer.
    "phi3": ("Phi3Config", {"sliding_window": 20, "pad_token_id": 0}),
    # Every second layer without rotary embedding, and sliding (a window of 12).
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "use_sliding_window": True, "sliding_window": 12,
                                  "pad_token_id": 0}),
    # Norms after each sublayer, and q/k RMSNorms over all heads together.
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}),
    # Rotary embedding over the first 12 of each head's 16 dims (Phi-4-mini's 0.75).
    "phi3-partial": ("Phi3Config", {"partial_rotary_factor": 0.75, "pad_token_id": 0}),
    # LongRoPE: the 167-token prompt runs past original_max_position_embeddings (the long factors, from its first
    # prefill chunk on), 40 and 32 grow past it (recomputed whole under the long factors, as transformers does),
    # the others stay within it (the short ones); cos/sin scaled by the attention factor.
    "phi3-longrope": ("Phi3Config", {"original_max_position_embeddings": 50, "pad_token_id": 0, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 12.0, 20.0, 40.0]}}),
    # Sandwich norms of (1 + weight), scaled embeddings, GELU, query_pre_attn_scalar, windows on alternate layers,
    # and soft caps that bite (weights drawn large enough that scores and logits reach past them).
    "gemma2": ("Gemma2Config", {"sliding_window": 12, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
                                "final_logit_softcapping": 2.0, "initializer_range": 0.2}),
    # Gemma 2's layers with q/k norms, one full layer to two sliding ones whose rope has a base of its own.
    "gemma3_text": ("Gemma3TextConfig", {"sliding_window": 20, "sliding_window_pattern": 2, "rope_theta": 10000.0,
                                         "rope_local_base_freq": 100.0, "query_pre_attn_scalar": 24,
                                         "final_logit_softcapping": 3.0}),
    # Mixtures of experts, 4 or 8 experts, top-2: Mixtral's (renormalized, on every layer) ...
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # ... Qwen3-MoE's (renormalized by norm_topk_prob; its second layer a dense MLP) ...
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # ... and Qwen2-MoE's (not renormalized, a shared expert under its sigmoid gate; MoE on the second layer only).
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "shared_expert_intermediate_size": 96, "decoder_sparse_step": 2}),
    # ... and gpt-oss's (the softmax of the top 2 biased logits; biased experts of a clamped SwiGLU), with
    # attention sinks, biased projections, windows on alternate layers and YaRN.
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                 "sliding_window": 12}),
}
MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss")


def decisive_routers(model) -> None:
    """Router weights large enough that no token's top k is a near tie: an initializer's tiny scores would let a
    last-bit rounding pick another expert."""
    for name, param in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight")):
            torch.nn.init.normal_(param, std=0.3)
        if name.endswith(("_bias", ".sinks")):  # gpt-oss's, zeros as initialised: random ones test their paths
            torch.nn.init.normal_(param, std=0.5)


def hf_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **generate) -> list[list[int]]:
    """One prompt at a time: no padding, so HF's numbers are the plain ones."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            # An explicit mask: otherwise generate infers one that hides prompt tokens equal to pad.
            ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, **generate)
            outs.append(ids[0, len(p):].tolist())
    return outs


def ours(llm: LLM, prompts: list[list[int]], **penalties) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **penalties)
    outs = llm.generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def pool_of(model_dir: Path, num_blocks: int) -> int:
    """kv_cache_memory that gives exactly `num_blocks` fp32 blocks (of the pool the KV-cache groups share, a block
    a page of each of a group's layers)."""
    return num_blocks * bytes_per_block(ModelConfig.from_file(model_dir / "config.json"), BS, torch.float32)


def small_pool(model_dir: Path, prompts: list[list[int]], chunk: int, spare: int = 3) -> int:
    """The blocks of a pool that holds the longest request alone (computed in steps of `chunk` tokens) with `spare`
    blocks over, far from the whole batch: its blocks in every KV-cache group counted, as they share the pool (13
    + 3 without windows)."""
    windows = [g.window for g in kv_groups(ModelConfig.from_file(model_dir / "config.json").layer_windows)]
    longest = max(map(len, prompts)) + NEW_TOKENS
    needed = sum(blocks_held_at_most(w, BS, longest, chunk) for w in windows)
    return needed + spare + any(w is not None for w in windows)  # where a group slides, the placeholder block


def check_scenarios(model_dir: Path, prompts: list[list[int]], expected: list[list[int]],
                    penalties: dict | None = None, **llm_kwargs) -> None:
    penalties = penalties or {}
    # Plain batch.
    llm = LLM(str(model_dir), block_size=BS, **llm_kwargs)
    assert ours(llm, prompts, **penalties) == expected
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]

    # (b) shared prefixes: the second call reuses blocks the first one left cached.
    assert ours(llm, prompts, **penalties) == expected
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    del llm

    # (a) a pool too small for the whole batch: preemption by recompute. Where every layer slides, sequences hold
    # their windows only and the batch fits (tests/test_kv_window.py preempts those). Beside full layers, a
    # decoding sequence's sliding groups give blocks back as often as its full ones take them: what runs short is
    # the long prompt's prefill, so it runs in chunks beside the decodes.
    config = ModelConfig.from_file(model_dir / "config.json")
    windowed = any(w is not None for w in config.layer_windows)
    kwargs = dict(llm_kwargs, max_num_batched_tokens=24) if windowed else llm_kwargs
    chunk = EngineConfig(**kwargs).batched_tokens("cpu")
    pool = pool_of(model_dir, small_pool(model_dir, prompts, chunk))
    llm = LLM(str(model_dir), block_size=BS, kv_cache_memory=pool, **kwargs)
    assert ours(llm, prompts, **penalties) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 or None not in config.layer_windows
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    del llm

    # (c) a token budget smaller than the long prompt: chunked prefill, prefix caching off.
    llm = LLM(str(model_dir), block_size=BS, max_num_batched_tokens=24, enable_prefix_caching=False,
              **llm_kwargs)
    assert ours(llm, prompts, **penalties) == expected
    stats = llm.stats()
    assert stats["prefix_cache_hits"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def tiny_hf_model(name: str):
    """The TINY family `name`'s model as transformers makes it: 3 layers, random fp32 weights of a fixed seed."""
    import transformers

    cls_name, extra = TINY[name]
    config = getattr(transformers, cls_name)(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, **extra)
    torch.manual_seed(1234)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_model(request, tmp_path_factory):
    model = tiny_hf_model(request.param)
    config = model.config
    if request.param.startswith("qwen2"):
        for layer in model.model.layers:  # random biases: zero ones would not test the bias path
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if request.param in MOE:
        decisive_routers(model)
    if request.param == "olmo2":  # norm weights of ones would not tell one norm's (or one head's) weight from another
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.normal_(param, mean=1.0, std=0.3)
    if request.param.startswith("gemma"):  # their norms' weights are offsets from 1, zeros as initialised
        for name, param in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(param, std=0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return path, prompts, hf_greedy(model, prompts)


def test_tiny_models_match_transformers(tiny_model):
    path, prompts, expected = tiny_model
    # Each request fits alone (the longest needs 13 blocks without windows, 3 spare), the batch needs ~45.
    check_scenarios(path, prompts, expected)


def test_n_greedy_samples_share_prompt_blocks_and_match(tiny_model):
    path, prompts, expected = tiny_model
    llm = LLM(str(path), block_size=BS)
    outs = llm.generate(prompts[:4], SamplingParams(n=3, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for out, exp in zip(outs, expected[:4], strict=True):
        assert [c.token_ids for c in out.outputs] == [exp] * 3
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


class OutputPenalties:
    """OpenAI's frequency and presence penalties as an HF logits processor (HF has only the repetition
    penalty): the tokens generated so far are counted, the prompt's are not."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4)


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_match_transformers(tiny_model, tmp_path, async_scheduling):
    """Greedy decoding with all three penalties gives HF's tokens (its repetition penalty, and the other
    two as a logits processor), also where the sampler's own token counts must be rebuilt: preemption,
    prefix-cache hits, chunked prefill, and steps scheduled ahead."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    path, prompts, _ = tiny_model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_greedy(model, [p], repetition_penalty=PENALTIES["repetition_penalty"],
                          logits_processor=LogitsProcessorList([OutputPenalties(
                              len(p), PENALTIES["frequency_penalty"], PENALTIES["presence_penalty"])]))[0]
                for p in prompts]
    assert expected != hf_greedy(model, prompts)  # the penalties do change the answer
    check_scenarios(path, prompts, expected, penalties=PENALTIES, async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.workers.loader import resolve_model

    source = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=torch.float32).eval()
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined a screw press with movable metal type. Within decades, printing shops spread across "
            "Europe, books became cheaper, and literacy rose. Scholars could share ideas faster than ever, "
            "and the Reformation, the Renaissance and the Scientific Revolution all drew on the new medium. "
            "Newspapers appeared in the seventeenth century, and by the nineteenth century steam-powered "
            "presses printed thousands of pages an hour. Today, digital printing and the internet continue "
            "that story, carrying text to billions of readers around the world in an instant.")
    ids = tok.encode(text + " " + text.replace("printing", "writing"))
    assert len(ids) >= max(PROMPT_LENS)
    prompts = [ids[:n] for n in PROMPT_LENS]
    return source.weights_dir, prompts, hf_greedy(model, prompts)


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers(smollm2):
    path, prompts, expected = smollm2
    check_scenarios(path, prompts, expected)


ROPE_SCALINGS = {  # kind: (rope_scaling, max_position_embeddings)
    "linear": ({"rope_type": "linear", "factor": 2.0}, 64),
    # The long prompts run past 64 positions, where dynamic NTK grows the base.
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 64),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, 128),
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(kind, tmp_path):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=ROPE_SCALINGS[kind][1],
        rope_scaling=dict(ROPE_SCALINGS[kind][0]), rope_theta=10000.0)
    torch.manual_seed(99)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    saved = ModelConfig.from_file(tmp_path / "config.json")
    assert saved.rope_scaling and saved.rope_scaling["rope_type"] == kind
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (5, 40, 90)]
    llm = LLM(str(tmp_path), block_size=BS)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        assert out.outputs[0].token_ids == ref.sequences[0, len(prompt):].tolist()
        # Tokens of a tiny random model rarely flip on a rope error; the logprobs of every step do.
        ref_lp = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(ref.scores, out.outputs[0].token_ids,
                                                                          strict=True)]
        got_lp = [e.logprob for e in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got_lp, ref_lp, strict=True)) < 1e-4


@pytest.mark.parametrize("family", ["granite", "gemma2", "gemma3_text"])
def test_logit_scales_and_caps_match_transformers_logprobs(tmp_path, family):
    """Greedy tokens do not move when logits are divided by a constant (Granite) or soft-capped (Gemma): the
    logprobs of every step do."""
    import transformers

    cls_name, extra = TINY[family]
    config = getattr(transformers, cls_name)(vocab_size=500, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             **extra)
    torch.manual_seed(98)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    out = LLM(str(tmp_path), block_size=BS).generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                               ignore_eos=True, logprobs=0))[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.outputs[0].token_ids
    assert tokens == ref.sequences[0, len(prompt):].tolist()
    ref_lp = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(ref.scores, tokens, strict=True)]
    got_lp = [e.logprob for e in out.outputs[0].logprobs]
    assert max(abs(a - b) for a, b in zip(got_lp, ref_lp, strict=True)) < 1e-4


def hf_logprobs(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """HF's greedy tokens after `prompt`, and the logprob of each at its step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = ref.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(ref.scores, tokens, strict=True)]


def test_phi3_longrope_and_partial_rotary_match_transformers_logprobs(tmp_path):
    """Phi-4-mini's rotary embedding: LongRoPE over the first 0.75 of each head. Prompts past
    original_max_position_embeddings take the long factors (also when prefilled in chunks that end before it), the
    others the short ones until they grow past it, when transformers recomputes the whole cache under the long
    ones, and so does the engine (with steps scheduled ahead too); the logprobs of every step tell a wrong factor,
    scale or rotated width."""
    import transformers

    config = transformers.Phi3Config(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        partial_rotary_factor=0.75, pad_token_id=0, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})
    torch.manual_seed(97)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    saved = ModelConfig.from_file(tmp_path / "config.json")
    assert saved.rope_scaling["rope_type"] == "longrope" and saved.rotary_dim == 12
    gen = torch.Generator().manual_seed(5)
    # Within 64 tokens to the end (short factors); growing past 64 (50, and 64 at its first draw); past 64 from the
    # prompt on (long factors). Twice: the second time from the prefix cache, whose blocks of the short factors
    # the long ones never take.
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (5, 30, 50, 64, 90, 130)]
    prompts += prompts[2:4]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    references = [hf_logprobs(model, prompt) for prompt in prompts]
    for llm_kwargs in ({}, {"max_num_batched_tokens": 24, "enable_prefix_caching": False},
                       {"async_scheduling": True}):
        llm = LLM(str(tmp_path), block_size=BS, **llm_kwargs)
        outs = llm.generate(prompts[:6], params) + llm.generate(prompts[6:], params)
        assert llm.stats()["num_preemptions"] >= 4  # each sequence that grew past 64, recomputed
        for (ref_tokens, ref_lp), out in zip(references, outs, strict=True):
            assert out.outputs[0].token_ids == ref_tokens
            got_lp = [e.logprob for e in out.outputs[0].logprobs]
            assert max(abs(a - b) for a, b in zip(got_lp, ref_lp, strict=True)) < 1e-4


def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration's text model (its language_model weights; the vision tower's are not read)
    gives transformers' tokens and logprobs for text prompts, with rope scaling on its full layers."""
    import transformers

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rope_scaling={"rope_type": "linear", "factor": 2.0},
                **TINY["gemma3_text"][1] | {"final_logit_softcapping": None})  # which its head never applies
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    for name, param in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(param, std=0.3)
    model.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 290, (n,), generator=gen).tolist() for n in (1, 15, 40, 70)]
    expected = hf_greedy(model, prompts)
    llm = LLM(str(tmp_path), block_size=BS)
    assert ours(llm, prompts) == expected
    out = llm.generate(prompts[2:3], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                    logprobs=0))[0]
    ref_tokens, ref_lp = hf_logprobs(model, prompts[2])
    assert out.outputs[0].token_ids == ref_tokens
    got_lp = [e.logprob for e in out.outputs[0].logprobs]
    assert max(abs(a - b) for a, b in zip(got_lp, ref_lp, strict=True)) < 1e-4


@pytest.mark.parametrize("family", [f for f in MOE if f != "gpt_oss"])
def test_moe_logprobs_match_transformers(tmp_path, family):
    """A routing error (a wrong expert, weight or renormalization) need not move a greedy token of a tiny model;
    the logprobs of every step show it. Prompts prefilled whole and in chunks, and decoded; the checkpoint in the
    per-expert layout transformers saves by default (Mixtral's w1/w2/w3 names) and in its own stacked one."""
    import transformers

    cls_name, extra = TINY[family]
    config = getattr(transformers, cls_name)(vocab_size=500, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                             **extra)
    torch.manual_seed(96)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    decisive_routers(model)
    model.save_pretrained(tmp_path / "original")
    model.save_pretrained(tmp_path / "stacked", save_original_format=False)
    from safetensors import safe_open

    layouts = {}
    for layout in ("original", "stacked"):
        with safe_open(tmp_path / layout / "model.safetensors", framework="pt") as f:
            layouts[layout] = any(key.endswith("experts.gate_up_proj") for key in f.keys())
    assert layouts == {"original": False, "stacked": True}
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (3, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    references = [hf_logprobs(model, prompt) for prompt in prompts]
    for layout, llm_kwargs in (("original", {}), ("original", {"max_num_batched_tokens": 24,
                                                                "enable_prefix_caching": False}), ("stacked", {})):
        outs = LLM(str(tmp_path / layout), block_size=BS, **llm_kwargs).generate(prompts, params)
        for (ref_tokens, ref_lp), out in zip(references, outs, strict=True):
            assert out.outputs[0].token_ids == ref_tokens
            got_lp = [e.logprob for e in out.outputs[0].logprobs]
            assert max(abs(a - b) for a, b in zip(got_lp, ref_lp, strict=True)) < 1e-4


def test_gpt_oss_logprobs_match_transformers(tmp_path):
    """gpt-oss's logprobs at every step (a wrong sink, bias, clamp, expert or YaRN frequency shows there, where a
    tiny model's greedy token may not move), prompts prefilled whole and in chunks, and decoded, from a checkpoint
    with the experts in MXFP4 as OpenAI's checkpoints store them (which transformers dequantizes on a CPU, and so does
    the loader). The layout transformers writes is checked to these bounds under tensor parallelism
    (`tests/test_cluster.py`)."""
    import transformers

    from tests.test_moe import load_dequantized, save_mxfp4

    config = transformers.GptOssConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, swiglu_limit=2.0,
                                       **TINY["gpt_oss"][1])
    torch.manual_seed(97)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    decisive_routers(model)
    save_mxfp4(model, tmp_path)
    model = load_dequantized(tmp_path)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (3, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    for llm_kwargs in ({}, {"max_num_batched_tokens": 24, "enable_prefix_caching": False}):
        outs = LLM(str(tmp_path), block_size=BS, **llm_kwargs).generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            ref_tokens, ref_lp = hf_logprobs(model, prompt)
            assert out.outputs[0].token_ids == ref_tokens
            got_lp = [e.logprob for e in out.outputs[0].logprobs]
            assert max(abs(a - b) for a, b in zip(got_lp, ref_lp, strict=True)) < 1e-4
