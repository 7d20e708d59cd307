"""LoRA adapters against PEFT: adapters made by PEFT from random initialization over a tiny checkpoint saved by
transformers (the real format, no downloads), run by the engine mixed in one batch with requests of the base
model, each request's greedy tokens those of `PeftModel.from_pretrained` over transformers in fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from tests.conftest import launched_batches

NEW_TOKENS = 10
BS = 4
# name: (rank, alpha, rslora, targets): ranks, scalings and targets of every kind, a fused projection's parts alone
ADAPTERS = {
    "attn": (4, 8, False, ["q_proj", "v_proj"]),
    "all": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp": (2, 4, True, ["up_proj", "down_proj"]),
    "kv": (6, 3, False, ["k_proj", "o_proj", "gate_proj"]),
}


def llama_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def make_adapter(base, path: Path, rank: int, alpha: int, rslora: bool, targets: list[str], seed: int,
                 **lora_options) -> None:
    """A PEFT adapter over `base` with random A and B (PEFT initializes B to zeros: an adapter that adds nothing)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                                                           target_modules=targets, **lora_options))
    for name, param in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param, std=0.15)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers, with the adapters of ADAPTERS beside it."""
    import transformers

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).eval()
    base.save_pretrained(root / "base")
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        make_adapter(base, root / name, *spec, seed=seed)
    return root


def peft_greedy(root: Path, adapter: str | None, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """PEFT's greedy tokens over transformers in fp32 (`adapter`: its directory under `root`; None: the base)."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, root / adapter).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]


def requests(root: Path) -> dict[str | None, LoRARequest | None]:
    return {None: None} | {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(ADAPTERS)}


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_adapters_mixed_with_the_base_model_match_peft_while_slots_swap(checkpoint):
    """Four adapters and the base model in one batch, two slots: the adapters take turns in the slots (swapped
    back in from host memory), through chunked prefill and preemption in a small pool; each request's tokens are
    PEFT's, and each adapter's differ from the base model's."""
    adapters = requests(checkpoint)
    batch_prompts = prompts(1, (5, 30, 13))
    work = [(p, name) for p in batch_prompts for name in adapters]
    llm = LLM(str(checkpoint / "base"), block_size=BS, enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=4, max_num_batched_tokens=24, kv_cache_memory=28 * BS * 2 * 2 * 2 * 16 * 4)
    with launched_batches(llm.llm_engine) as batches:
        outs = llm.generate([p for p, _ in work], GREEDY, lora_request=[adapters[name] for _, name in work])
        # again, the other way round: the adapters the first batch ended with make way for the others
        again = llm.generate([p for p, _ in work[::-1]], GREEDY, lora_request=[adapters[n] for _, n in work[::-1]])
    got = {(tuple(p), name): o.outputs[0].token_ids for (p, name), o in zip(work, outs, strict=True)}
    for p, name in work:
        assert got[tuple(p), name] == peft_greedy(checkpoint, name, p), (name, len(p))
        if name is not None:
            assert got[tuple(p), name] != got[tuple(p), None], f"adapter {name} changed nothing"
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[::-1]]
    assert llm.stats()["num_preemptions"] > 0
    in_slots = llm.stats()["adapters"]  # the ids of the adapters the two slots hold now
    assert len(in_slots) == 2 and set(in_slots) < {a.lora_int_id for a in adapters.values() if a is not None}
    assert max(len({s for s in b.lora_slots if s >= 0}) for b in batches) == 2
    loads = [lora.lora_name for b in batches for _, lora in b.lora_loads]
    assert len(loads) > len(ADAPTERS) and set(loads) == set(ADAPTERS), loads


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(checkpoint):
    """The same prompt under each adapter and the base model computes its prompt anew; under the same adapter
    again its blocks are found."""
    adapters = requests(checkpoint)
    prompt = prompts(2, (3 * BS + 1,))[0]
    llm = LLM(str(checkpoint / "base"), block_size=BS, enable_lora=True, max_loras=4, max_lora_rank=8)
    cached = []
    for name in ["attn", None, "all", "attn", None, "mlp", "kv", "all"]:
        out = llm.generate([prompt], GREEDY, lora_request=adapters[name])[0]
        assert out.outputs[0].token_ids == peft_greedy(checkpoint, name, prompt), name
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 3 * BS, 3 * BS, 0, 0, 3 * BS]


def test_a_swapped_out_adapter_comes_back_from_host_memory(checkpoint, tmp_path):
    """max_cpu_loras keeps read adapters in host memory: one whose directory is gone by then still runs."""
    shutil.copytree(checkpoint / "attn", tmp_path / "attn")
    attn, mlp = LoRARequest("attn", 1, str(tmp_path / "attn")), LoRARequest("mlp", 2, str(checkpoint / "mlp"))
    prompt = prompts(3, (9,))[0]
    llm = LLM(str(checkpoint / "base"), block_size=BS, enable_lora=True, max_loras=1, max_cpu_loras=2,
              max_lora_rank=8, enable_prefix_caching=False)
    first = llm.generate([prompt], GREEDY, lora_request=attn)[0].outputs[0].token_ids
    llm.generate([prompt], GREEDY, lora_request=mlp)  # takes the one slot
    shutil.rmtree(tmp_path / "attn")
    assert llm.generate([prompt], GREEDY, lora_request=attn)[0].outputs[0].token_ids == first


def test_beam_search_and_samples_run_with_their_adapter(checkpoint):
    """A beam search's step requests and a request's n samples all run with its adapter: the best beam of width 1
    is greedy decoding, and n seeded samples at temperature 0 are the greedy tokens n times."""
    adapter = requests(checkpoint)["all"]
    prompt = prompts(4, (7,))[0]
    want = peft_greedy(checkpoint, "all", prompt)
    llm = LLM(str(checkpoint / "base"), block_size=BS, enable_lora=True, max_lora_rank=8)
    beam = llm.generate([prompt], SamplingParams(use_beam_search=True, n=1, max_tokens=NEW_TOKENS, ignore_eos=True),
                        lora_request=adapter)[0]
    assert beam.outputs[0].token_ids == want
    samples = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           lora_request=adapter)[0]
    assert [c.token_ids for c in samples.outputs] == [want] * 3


def broken(root: Path, tmp_path: Path, how: str) -> tuple[Path, str]:
    """An adapter directory broken in one way, and what the error must say."""
    import transformers

    path = tmp_path / how
    if how in ("lm_head", "embed_tokens", "dora", "bias", "rank"):
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
        options = {"lm_head": dict(targets=["q_proj", "lm_head"]), "embed_tokens": dict(targets=["embed_tokens"]),
                   "dora": dict(targets=["q_proj"], use_dora=True), "bias": dict(targets=["q_proj"], bias="all"),
                   "rank": dict(targets=["q_proj"], rank=32)}[how]
        spec = {"rank": 4, "alpha": 8, "rslora": False} | options
        make_adapter(base, path, spec.pop("rank"), spec.pop("alpha"), spec.pop("rslora"), spec.pop("targets"),
                     seed=0, **spec)
        return path, {"lm_head": "lm_head", "embed_tokens": "embed_tokens", "dora": "use_dora=True",
                      "bias": "bias='all'", "rank": "max_lora_rank=8"}[how]
    shutil.copytree(root / "attn", path)
    if how == "no config":
        (path / "adapter_config.json").unlink()
        return path, "no adapter_config.json"
    if how == "not json":
        (path / "adapter_config.json").write_text("{r: 4")
        return path, "adapter_config.json is not JSON"
    if how == "no weights":
        (path / "adapter_model.safetensors").unlink()
        return path, "no adapter_model.safetensors"
    if how == "truncated weights":
        data = (path / "adapter_model.safetensors").read_bytes()
        (path / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
        return path, "cannot be read"
    if how == "wrong rank":  # a config whose r is not the rank its tensors have
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(config | {"r": 2}))
        return path, "has shape [4, 64], the model needs [2, 64]"
    assert how == "missing"
    shutil.rmtree(path)
    return path, "is not a directory"


BROKEN = ("missing", "no config", "not json", "no weights", "truncated weights", "wrong rank", "lm_head",
          "embed_tokens", "dora", "bias", "rank")


def test_a_broken_adapter_is_refused_naming_the_problem_and_the_engine_goes_on(checkpoint, tmp_path):
    llm = LLM(str(checkpoint / "base"), block_size=BS, enable_lora=True, max_lora_rank=8)
    prompt = prompts(5, (6,))[0]
    for i, how in enumerate(BROKEN):
        path, says = broken(checkpoint, tmp_path, how)
        with pytest.raises(ValueError, match="prompts\\[0\\]: lora adapter") as refused:
            llm.generate([prompt], GREEDY, lora_request=LoRARequest(how, 100 + i, str(path)))
        assert says in str(refused.value), (how, str(refused.value))
    adapter = requests(checkpoint)["attn"]
    out = llm.generate([prompt], GREEDY, lora_request=adapter)[0]
    assert out.outputs[0].token_ids == peft_greedy(checkpoint, "attn", prompt)
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_total_blocks


def test_adapters_of_experts_are_refused_and_attention_adapters_run_on_a_mixture_of_experts(tmp_path):
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=256, mlp_only_layers=[1])
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path / "base")
    make_adapter(base, tmp_path / "attn", 4, 8, False, ["q_proj", "o_proj"], seed=1)
    # PEFT adapts the experts' stacked projections as parameters (`target_parameters`)
    make_adapter(base, tmp_path / "experts", 4, 8, False, ["down_proj"], seed=2)
    llm = LLM(str(tmp_path / "base"), block_size=BS, enable_lora=True, max_lora_rank=8)
    prompt = prompts(6, (8,))[0]
    with pytest.raises(ValueError, match="target_parameters=.* is not supported .*a mixture of experts' stacked"):
        llm.generate([prompt], GREEDY, lora_request=LoRARequest("experts", 2, str(tmp_path / "experts")))
    out = llm.generate([prompt], GREEDY, lora_request=LoRARequest("attn", 1, str(tmp_path / "attn")))[0]
    assert out.outputs[0].token_ids == peft_greedy(tmp_path, "attn", prompt)


def test_lora_settings_and_requests_are_refused_where_they_cannot_run(checkpoint):
    base = str(checkpoint / "base")
    for settings, says in [({"max_loras": 2}, "max_loras=2 needs enable_lora=True"),
                           ({"enable_lora": True, "max_loras": 0}, "max_loras=0 must be an integer >= 1"),
                           ({"enable_lora": True, "max_loras": 3, "max_cpu_loras": 2},
                            "max_cpu_loras=2 must be at least max_loras=3"),
                           ({"enable_lora": "yes"}, "enable_lora='yes' must be true or false")]:
        with pytest.raises(ValueError, match=says):
            LLM(base, **settings)
    with pytest.raises(ValueError, match="lora_request.lora_int_id=0 must be an integer >= 1"):
        LoRARequest("x", 0, "/x")
    attn = requests(checkpoint)["attn"]
    llm = LLM(base, block_size=BS)
    with pytest.raises(ValueError, match="adapters need an engine with enable_lora=True"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=attn)
    llm = LLM(base, block_size=BS, enable_lora=True, max_lora_rank=8)
    llm.generate([[1, 2, 3]], GREEDY, lora_request=attn)
    with pytest.raises(ValueError, match="lora_int_id=1 already stands for the adapter at"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("mlp", 1, str(checkpoint / "mlp")))
    with pytest.raises(ValueError, match="lora_request has 2 entries for 1 prompts"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=[attn, None])
