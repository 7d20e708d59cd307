"""The engine on a real local Ray cluster: worker actors, tensor parallelism, the engine as a Serve replica
hosts it, faults."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest
import ray
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig, ray_hosted_config
from pagedserve.engine.async_engine import AsyncEngine, RequestFailed
from pagedserve.executors.ray_executor import StepOrder

from .conftest import launched_batches
from .test_async_scheduling import PROMPTS, check_grammars_scheduled_ahead, check_same_outputs, grammar_mix
from .test_parity import hf_greedy, hf_logprobs

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    # More logical CPUs than cores: up to four single-CPU worker actors share the two cores.
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """Qwen2 (q/k/v bias), 4 heads / 2 KV heads, untied LM head, vocab not divisible by 4."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    torch.manual_seed(21)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp("qwen2_tp")
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1001, (n,), generator=gen).tolist() for n in (1, 15, 16, 17, 70)]
    return str(path), prompts, hf_greedy(model, prompts, new_tokens=16)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# Qwen2's window on its second layer only; Gemma's: tied embeddings (each rank holds its vocabulary rows), a window
# on the first layer only; Gemma 2's scores soft-capped (weights large enough that the cap bites), Gemma 3's sliding
# layer with a rope base of its own.
WINDOW_MODELS = {
    "MistralConfig": {},
    "Phi3Config": {},
    "Qwen2Config": dict(use_sliding_window=True, max_window_layers=1),
    "Gemma2Config": dict(tie_word_embeddings=True, attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
                         query_pre_attn_scalar=24, initializer_range=0.2),
    "Gemma3TextConfig": dict(tie_word_embeddings=True, sliding_window_pattern=2, rope_local_base_freq=100.0,
                             rope_theta=10000.0, query_pre_attn_scalar=24),
}


@pytest.fixture(scope="module", params=["MistralConfig", "Phi3Config", "Qwen2Config",
                                        pytest.param("Gemma2Config", marks=pytest.mark.slow),
                                        pytest.param("Gemma3TextConfig", marks=pytest.mark.slow)])
def tiny_window_model(request, tmp_path_factory):
    """A sliding window of 8 positions (prompts run up to 70 tokens past it) on every layer: Mistral's, and
    Phi-3's, whose checkpoint holds q/k/v and gate/up fused (each rank reads its rows of each part); on the second
    layer only, Qwen2's (two KV-cache groups, each with its pool on every rank); on Gemma's sliding layers."""
    import transformers

    config = getattr(transformers, request.param)(**dict(
        vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, sliding_window=8,
        pad_token_id=0) | WINDOW_MODELS[request.param])
    torch.manual_seed(22)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(f"{request.param}_window_tp")
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1001, (n,), generator=gen).tolist() for n in (1, 9, 17, 70)]
    return str(path), prompts, hf_greedy(model, prompts, new_tokens=16)


def test_tensor_parallel_sliding_window_matches_transformers(tiny_window_model):
    """Each rank's heads attend over the same window: tensor parallelism splits heads, never positions."""
    path, prompts, expected = tiny_window_model
    with LLM(path, executor="ray", tensor_parallel_size=2) as llm:
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


# Families whose layers differ from Llama's in what tensor parallelism splits or sums. Each: (config class, its keys,
# prompt lengths, tensor-parallel sizes).
TP_FAMILIES = {
    # Scaled embeddings, residual adds, attention scores and logits: each scale applied once, not once per rank.
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                  "attention_multiplier": 0.2, "logits_scaling": 8.0}, (1, 17, 70), (2,)),
    # Every second layer without rotary embedding, and those sliding.
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "use_sliding_window": True, "sliding_window": 8},
                (1, 17, 70), (2,)),
    # q/k norms over all heads: each rank's partial mean of squares summed, its share of the weights; at 4 ranks the
    # 2 KV heads are each held twice, and counted once.
    "olmo2": ("Olmo2Config", {}, (1, 17, 70), (2, 4)),
    # q/k norms per head: each rank normalizes its own heads by the shared weight.
    "qwen3": ("Qwen3Config", {"head_dim": 16}, (1, 17, 70), (2,)),
    # LongRoPE over 0.75 of each head (Phi-4-mini's): 40 and 70 past original_max_position_embeddings, 1 and 9
    # within it to the end, 20 growing past it (recomputed under the long factors).
    "phi3-longrope": ("Phi3Config", {"original_max_position_embeddings": 32, "partial_rotary_factor": 0.75,
                                     "rope_scaling": {"rope_type": "longrope",
                                                      "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
                                                      "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}},
                      (1, 9, 20, 40, 70), (2,)),
    # Mixtures of experts: every expert split along its intermediate dimension, the router replicated, the block's
    # output all-reduced once; Qwen2-MoE's shared expert split as a dense MLP (its second layer dense).
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, (1, 17, 70), (2,)),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "norm_topk_prob": True}, (1, 17, 70), (2,)),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "shared_expert_intermediate_size": 96, "mlp_only_layers": [1]},
                  (1, 17, 70), (2,)),
    # gpt-oss: each rank its heads' sinks and its columns of every expert's biased projections; one rank adds the
    # experts' down biases before the all-reduce. Its first layer slides (a window of 12), its second does not.
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                 "sliding_window": 12}, (1, 17, 70), (2,)),
}


@pytest.fixture(scope="module", params=sorted(TP_FAMILIES))
def tiny_family(request, tmp_path_factory):
    """A family's tiny model (random norm weights), its prompts, and transformers' greedy tokens and their
    logprobs for each."""
    import transformers

    cls_name, extra, lengths, sizes = TP_FAMILIES[request.param]
    config = getattr(transformers, cls_name)(
        vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, **extra)
    torch.manual_seed(23)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # ones would hide a rank reading another's share
                param.normal_(1.0, 0.3)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight")):
                param.normal_(0.0, 0.3)  # no near ties among experts
            if name.endswith(("_bias", ".sinks")):  # gpt-oss's, zeros as initialised
                param.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp(f"{request.param}_tp")
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 1001, (n,), generator=gen).tolist() for n in lengths]
    expected = [hf_logprobs(model, p, new_tokens=16) for p in prompts]
    return str(path), prompts, expected, sizes


@pytest.mark.slow
def test_tensor_parallel_families_match_transformers(tiny_family):
    """Tokens, and each step's logprob (to 1e-4: the ranks' partial sums add in another order)."""
    path, prompts, expected, sizes = tiny_family
    for tp in sizes:
        with LLM(path, executor="ray", tensor_parallel_size=tp) as llm:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0))
            for out, (tokens_hf, logprobs_hf) in zip(outs, expected, strict=True):
                assert out.outputs[0].token_ids == tokens_hf, tp
                got = [e.logprob for e in out.outputs[0].logprobs]
                assert max(abs(a - b) for a, b in zip(got, logprobs_hf, strict=True)) < 1e-4, tp
            stats = llm.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]


# 4 > num_kv_heads: KV heads are replicated. Async scheduling: rank 0 shares each step's draws with the others.
@pytest.mark.parametrize(("tp", "async_scheduling"), [(1, False), (2, False), (2, True), (4, True)])
def test_tensor_parallel_matches_transformers(tiny_qwen2, tp, async_scheduling):
    path, prompts, expected = tiny_qwen2
    with LLM(path, executor="ray", tensor_parallel_size=tp, async_scheduling=async_scheduling) as llm:
        assert llm.llm_engine.schedules_ahead == async_scheduling
        with launched_batches(llm.llm_engine) as batches:
            assert tokens(llm.generate(prompts, GREEDY)) == expected
        sent = [bool(b.deferred_inputs) for b in batches]
        assert sum(sent) > 5 if async_scheduling else not any(sent), sent
        stats = llm.stats()
        assert stats["tensor_parallel_size"] == tp
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_the_kv_offload_tier_over_tensor_parallel_worker_actors(tiny_qwen2, tmp_path):
    """Two ranks, each keeping its own KV heads in a disk tier of its own, steps scheduled ahead: a pool too small
    to keep the prompts between turns restores their blocks, with transformers' tokens every turn."""
    path, prompts, expected = tiny_qwen2
    with LLM(path, executor="ray", tensor_parallel_size=2, async_scheduling=True, block_size=4,
             kv_cache_memory="24KiB", kv_offload_disk="256KiB", kv_offload_dir=str(tmp_path)) as llm:
        for _ in range(2):
            assert [tokens(llm.generate([p], GREEDY))[0] for p in prompts] == expected
        stats = llm.stats()
    assert stats["num_total_blocks"] == 24 and stats["offload_restored_blocks"] >= 17
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_prefixes_move_between_tensor_parallel_replicas_through_the_object_store(tiny_qwen2):
    """Two replicas of two ranks each, steps scheduled ahead: the one that computed the prompts exports their blocks
    by reference (each rank's pages go from its worker to the same rank's of the other replica through Ray's object
    store), and the other, computing only what follows them, gives transformers' tokens. Pages whose owner died
    before they were fetched (a holder lost in the middle of a transfer) fail the import, which is released; at the
    end no block is held and no worker keeps a page."""
    from pagedserve.scheduler.prefix_transfer import PrefixExport

    from .test_kv_transfer import export

    path, prompts, expected = tiny_qwen2
    settings = dict(executor="ray", tensor_parallel_size=2, async_scheduling=True, block_size=4)

    def run(llm: LLM, imports: list) -> list[list[int]]:
        engine = llm.llm_engine
        ids = [engine.add_request(p, GREEDY, kv_import=i) for p, i in zip(prompts, imports, strict=True)]
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        return [done[i] for i in ids]

    def held(llm: LLM) -> list[int]:
        return ray.get([w.__ray_call__.remote(lambda actor: actor.worker.runner.transfer.num_held)
                        for w in llm.llm_engine.executor.workers])

    @ray.remote(num_cpus=0)
    class Owner:
        def keep(self, pages: list) -> list:
            return [ray.put(p) for p in pages]

    with LLM(path, **settings) as holder, LLM(path, **settings) as llm:
        holder.generate(prompts, GREEDY)
        exports = [export(holder, p) for p in prompts]
        assert [len(e.hashes) for e in exports] == [len(p) // 4 for p in prompts]  # every full block
        assert all(isinstance(ref, ray.ObjectRef) for e in exports for ref in e.pages)
        imports = [llm.llm_engine.import_prefix(e, p) for e, p in zip(exports, prompts, strict=True)]
        assert [i is None for i in imports] == [True, False, False, False, False]  # the 1-token prompt has none
        assert run(llm, imports) == expected
        stats = llm.stats()
        assert stats["kv_transfer_hits"] == sum((len(p) - 1) // 4 * 4 for p in prompts)

        owner = Owner.remote()
        orphaned = PrefixExport(exports[-1].first_block, exports[-1].hashes,
                                ray.get(owner.keep.remote(ray.get(exports[-1].pages))))
        ray.kill(owner)
        deadline = time.monotonic() + 30
        while True:  # until the pages are lost with it (ray.kill returns before the actor is gone)
            try:
                ray.get(orphaned.pages[0], timeout=5)
            except ray.exceptions.OwnerDiedError:
                break
            assert time.monotonic() < deadline, "pages outlived their owner"
            time.sleep(0.2)
        assert llm.llm_engine.import_prefix(orphaned, prompts[-1]) is None
        assert llm.stats()["kv_transfer_failures"] == 1
        assert run(llm, [None] * len(prompts)) == expected  # the step that released the failed import's pages ran
        assert held(llm) == held(holder) == [0, 0]
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_async_scheduling_on_worker_actors(embedded_dir):
    """The mixed workload (stops, seeds, n, penalties, logprobs, a grammar, preemption) scheduled ahead on a
    worker actor gives the in-process engine's outputs stepping one at a time."""
    check_same_outputs(embedded_dir, executor="ray")


# SmolLM2's 9 heads and 3 KV heads split over 3 ranks; ranks 1 and 2 wait for rank 0's draws in a collective.
@pytest.mark.parametrize("tp", [1, 3])
def test_grammar_masks_reach_a_worker_actor_after_the_launch(embedded_dir, tp):
    """Rank 0's actor holds a step that waits for its grammar masks, which come by a call of their own."""
    check_grammars_scheduled_ahead(embedded_dir, executor="ray", tensor_parallel_size=tp)


def test_a_failed_step_releases_a_worker_waiting_for_grammar_masks(embedded_dir, monkeypatch):
    """An engine error while a step waits for its masks fails the requests; the waiting step is let go, so
    the next request runs at once instead of queueing behind it until the step timeout."""
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.structured_output.grammars import GrammarManager

    engine = LLMEngine(EngineConfig(model=str(embedded_dir), executor="ray", async_scheduling=True))
    try:
        grammar = grammar_mix()[2]  # JSON: long enough to be scheduled ahead a few times
        ids = [engine.add_request(p, grammar) for p in PROMPTS[:3]]
        late = GrammarManager.late_masks
        calls = []

        def fails_once(self, batch, seqs):
            calls.append(len(batch.late_masks))
            if len(calls) == 3:
                raise RuntimeError("injected engine fault")
            return late(self, batch, seqs)

        monkeypatch.setattr(GrammarManager, "late_masks", fails_once)
        failed = []
        while engine.has_unfinished_requests():
            failed += [out for out in engine.step() if out.finished]
        assert len(calls) == 3 and sorted(out.request_id for out in failed) == sorted(ids)
        assert all("injected engine fault" in out.error for out in failed)

        t0 = time.monotonic()
        engine.add_request(PROMPTS[3], GREEDY)
        done = []
        while engine.has_unfinished_requests() and time.monotonic() - t0 < 60:
            done += [out for out in engine.step() if out.finished]
        assert len(done) == 1 and len(done[0].outputs[0].token_ids) == 16, done
        assert time.monotonic() - t0 < 60
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        engine.shutdown()


def test_step_order_launches_steps_in_their_numbered_order():
    """Ray may start a later step's call first on an actor with two step threads."""
    order = StepOrder()
    launched = []

    def step(n: int, fail: bool = False) -> None:
        try:
            order.wait(n)
        except RuntimeError as e:
            launched.append((n, str(e)))
            return
        launched.append(n)
        order.done(n, ok=not fail)

    threads = [threading.Thread(target=step, args=(n,)) for n in (2, 1)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert launched == []  # both wait for step 0
    step(0)
    for t in threads:
        t.join(timeout=5)
    assert launched == [0, 1, 2]
    step(3, fail=True)
    step(4)  # its deferred inputs would come from the failed step
    assert launched[3] == 3 and launched[4] == (4, "step 4 cannot run: step 3 before it failed")


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1_and_transformers(embedded_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_dir)
    prompts = [tok.encode(t) for t in ("The capital of France is", "Once upon a time, in a small village",
                                       "def fibonacci(n):")]
    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    expected = hf_greedy(model, prompts, new_tokens=16)
    assert tokens(LLM(str(embedded_dir)).generate(prompts, GREEDY)) == expected
    with LLM(str(embedded_dir), executor="ray", tensor_parallel_size=3) as llm:  # 9 heads, 3 KV heads
        assert tokens(llm.generate(prompts, GREEDY)) == expected
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide num_attention_heads=9"):
        LLM(str(embedded_dir), executor="ray", tensor_parallel_size=2)


def test_worker_cpus_are_reserved_and_computed_on(tiny_qwen2, caplog):
    from pagedserve.serving.model_server import model_server_options

    path, prompts, expected = tiny_qwen2
    with LLM(path, executor="ray", tensor_parallel_size=2, worker_cpus=3) as llm:
        executor = llm.llm_engine.executor
        assert executor.placement_group.bundle_specs == [{"CPU": 3.0}, {"CPU": 3.0}]
        threads = ray.get([w.__ray_call__.remote(lambda actor: torch.get_num_threads()) for w in executor.workers])
        assert threads == [3, 3]
        assert tokens(llm.generate(prompts, GREEDY)) == expected
    config = EngineConfig(model=path, worker_cpus=2, device="cpu")
    assert model_server_options(config, num_replicas=2)["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 2}]
    assert "without worker_cpus" not in caplog.text
    model_server_options(EngineConfig(model=path, device="cpu"), num_replicas=2)
    assert "several model replicas on CPUs without worker_cpus" in caplog.text
    with pytest.raises(ValueError, match="worker_cpus=0 must be an integer >= 1"):
        EngineConfig(worker_cpus=0)


def test_ranks_may_share_a_gpu_over_gloo_and_never_in_cuda_graphs():
    """gpus_per_worker below 1: each worker reserves that share of a GPU, so two ranks fit on one; they then talk
    over gloo, which a CUDA graph cannot capture. Refused by name where it means nothing."""
    from pagedserve.executors.ray_executor import worker_bundle

    shared = EngineConfig(device="cuda", executor="ray", tensor_parallel_size=2, gpus_per_worker=0.5)
    assert worker_bundle(shared) == {"GPU": 0.5, "CPU": 1}
    assert shared.shares_gpus() and not shared.replays_graphs("cuda") and shared.schedules_ahead("cuda")
    assert worker_bundle(EngineConfig(device="cuda", executor="ray")) == {"GPU": 1.0, "CPU": 1}
    assert EngineConfig(device="cuda", executor="ray", gpus_per_worker=0.5).replays_graphs("cuda")  # one rank
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(ValueError, match=rf"gpus_per_worker={bad!r} must be a number in \(0, 1\]"):
            EngineConfig(executor="ray", gpus_per_worker=bad)
    with pytest.raises(ValueError, match="gpus_per_worker=0.5 needs executor='ray'"):
        EngineConfig(gpus_per_worker=0.5)
    with pytest.raises(ValueError, match="gpus_per_worker=0.5 has no meaning with device='cpu'"):
        EngineConfig(executor="ray", device="cpu", gpus_per_worker=0.5)
    with pytest.raises(ValueError, match="cuda_graphs=True with gpus_per_worker=0.5 and tensor_parallel_size=2"):
        EngineConfig(executor="ray", tensor_parallel_size=2, gpus_per_worker=0.5, cuda_graphs=True)
    from pagedserve.workers.worker import process_group_backend

    assert process_group_backend(torch.device("cuda", 0), shared.shares_gpus()) == "gloo"
    assert process_group_backend(torch.device("cuda", 0), shared_device=False) == "nccl"
    assert process_group_backend(torch.device("cpu"), shared_device=False) == "gloo"


@ray.remote(num_cpus=1)
def _collectives_of_rank(rank: int, init_method: str) -> dict[str, object]:
    """One rank of two: joins the group as a worker does, runs each collective the model and the runner use."""
    import types

    import torch.distributed as dist

    from pagedserve.workers.models.parallel import TPLayout, all_gather_last_dim, all_reduce, broadcast
    from pagedserve.workers.worker import _init_distributed

    backend = _init_distributed(torch.device("cpu"), rank, 2, init_method)
    try:
        shape = types.SimpleNamespace(num_heads=2, num_kv_heads=2, intermediate_size=2, moe_intermediate_size=0,
                                      shared_expert_intermediate_size=0, vocab_size=10)
        layout = TPLayout.make(shape, rank, 2, host_collectives=backend == "gloo")
        summed = torch.arange(6.0).reshape(2, 3) * (rank + 1)  # [2, 3]
        reduced = all_reduce(summed, layout)
        local = (torch.arange(6.0).reshape(3, 2) + 10 * rank).t()  # [2, 3], not contiguous
        draws = torch.tensor([7, 8, 9]) if rank == 0 else torch.zeros(3, dtype=torch.long)  # [3]
        return {"backend": backend, "host": layout.host_collectives, "in_place": reduced is summed,
                "reduced": summed, "gathered": all_gather_last_dim(local, layout),
                "draws": broadcast(draws, layout, src=0)}
    finally:
        dist.destroy_process_group()


def test_collectives_of_a_gloo_group_go_through_host_copies():
    """Two real ranks in a gloo group take the host-copy path of the collectives, as ranks sharing a GPU do (on a
    CPU the host copies are the tensors themselves): the sum in place, the gather in rank order from a
    non-contiguous shard, rank 0's draws everywhere."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = ray.get([_collectives_of_rank.remote(rank, f"tcp://127.0.0.1:{port}") for rank in (0, 1)])
    for result in results:
        assert result["backend"] == "gloo" and result["host"] and result["in_place"]
        assert torch.equal(result["reduced"], torch.arange(6.0).reshape(2, 3) * 3)
        expected = torch.cat([(torch.arange(6.0).reshape(3, 2) + 10 * r).t() for r in (0, 1)], dim=-1)  # [2, 6]
        assert torch.equal(result["gathered"], expected)
        assert result["draws"].tolist() == [7, 8, 9]


def test_tensor_parallel_needs_ray_executor(tiny_qwen2):
    with pytest.raises(ValueError, match="executor='ray'"):
        LLM(tiny_qwen2[0], tensor_parallel_size=2)


@contextlib.contextmanager
def ray_hosted_engine(stream_interval_ms=0, **config):
    """The engine as a Serve replica hosts it (`ModelServer`: an `AsyncEngine` whose workers are Ray actors),
    for one test; its workers go away afterwards. Used on one event loop (one `asyncio.run`)."""
    engine = AsyncEngine(ray_hosted_config(EngineConfig(**config)), stream_interval_ms=stream_interval_ms)
    try:
        yield engine
    finally:
        engine.shutdown()


async def collect(engine, prompt, params, request_id=None):
    last = None
    async for out in engine.generate(prompt, params, request_id):
        last = out
    return last


def test_ray_hosted_engine_serves_200_concurrent_requests(tiny_qwen2):
    path, prompts, expected = tiny_qwen2
    # Outputs merged within 50 ms: each stream's last output still holds every token
    with ray_hosted_engine(model=path, max_num_seqs=64, stream_interval_ms=50) as engine:
        async def run():
            jobs = []
            for i in range(200):
                if i % 10 == 0:  # some with known greedy answers
                    jobs.append(collect(engine, prompts[i // 10 % len(prompts)], GREEDY))
                else:
                    jobs.append(collect(engine, [i % 1001, 7, 8], SamplingParams(max_tokens=1 + i % 23, seed=i,
                                                                                   ignore_eos=True)))
            return await asyncio.gather(*jobs)

        outs = asyncio.run(run())
        for i, out in enumerate(outs):
            assert out.finished
            if i % 10 == 0:
                assert out.outputs[0].token_ids == expected[i // 10 % len(prompts)]
            else:
                assert len(out.outputs[0].token_ids) == 1 + i % 23
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert stats["num_running"] == stats["num_waiting"] == stats["num_streams"] == 0


def test_bad_request_to_the_ray_hosted_engine_names_the_field(tiny_qwen2):
    with ray_hosted_engine(model=tiny_qwen2[0]) as engine:
        bad = SamplingParams(max_tokens=4)
        bad.top_p = 0.0

        async def run():
            with pytest.raises(ValueError, match="top_p"):
                await collect(engine, [1, 2, 3], bad)
            return await collect(engine, [1, 2, 3], GREEDY)

        out = asyncio.run(run())
        assert len(out.outputs[0].token_ids) == 16


def test_cancelled_stream_frees_its_blocks(tiny_qwen2):
    with ray_hosted_engine(model=tiny_qwen2[0]) as engine:
        async def run():
            # A stream cancelled as Serve cancels a replica's call when its caller goes away.
            first = asyncio.Event()

            async def read():
                async for _ in engine.generate([5] * 40, SamplingParams(max_tokens=400, ignore_eos=True)):
                    first.set()

            stream = asyncio.ensure_future(read())
            await first.wait()
            stream.cancel()
            for _ in range(100):
                stats = engine.stats()
                if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
                    return stats
                await asyncio.sleep(0.1)
            return stats

        stats = asyncio.run(run())
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


@ray.remote(num_cpus=0)
class EngineHost:
    """An `AsyncEngine` hosted in an async actor, as a Serve replica hosts it: each request an actor call."""

    def __init__(self, model: str) -> None:
        self.engine = AsyncEngine(ray_hosted_config(EngineConfig(model=model)))

    async def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        outputs = [out async for out in self.engine.generate(prompt, SamplingParams(max_tokens=max_tokens,
                                                                                    ignore_eos=True))]
        return outputs[-1].outputs[0].token_ids

    def num_running(self) -> int:
        return self.engine.stats()["num_running"]


def test_cancelling_the_call_that_started_the_step_loop_leaves_other_requests_alone(tiny_qwen2):
    """Serve cancels a replica's call when its client goes away, and Ray then cancels the tasks that call
    submitted. The engine's step loop, started by whichever request came first, submits every step's tasks to the
    workers: none of them may count as that request's, or its cancellation would fail every other request."""
    host = EngineHost.remote(tiny_qwen2[0])
    try:
        first = host.generate.remote([5] * 20, 400)  # it starts the step loop
        while ray.get(host.num_running.remote()) == 0:
            time.sleep(0.05)
        second = host.generate.remote([6] * 20, 60)
        while ray.get(host.num_running.remote()) < 2:
            time.sleep(0.05)
        ray.cancel(first)  # recursive, as Serve's cancellation is
        assert len(ray.get(second, timeout=60)) == 60
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(first, timeout=60)
    finally:
        ray.kill(host)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_killed_worker_fails_requests_then_engine_recovers(tiny_qwen2, async_scheduling):
    path, prompts, expected = tiny_qwen2
    with ray_hosted_engine(model=path, executor="ray", tensor_parallel_size=2,
                           async_scheduling=async_scheduling) as engine:
        async def run():
            started = asyncio.Event()  # a request with tokens out fails; one that has none runs again

            async def stream_long() -> None:
                async for _ in engine.generate([3] * 30, SamplingParams(max_tokens=400, ignore_eos=True)):
                    started.set()

            long_job = asyncio.ensure_future(stream_long())
            await started.wait()
            pids = await engine.worker_pids()
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RequestFailed, match="worker"):
                await asyncio.wait_for(long_job, timeout=30)
            failed_after = time.monotonic() - t0
            # The next request runs on rebuilt workers.
            out = await collect(engine, prompts[4], GREEDY)
            return failed_after, out, engine.stats(), pids, await engine.worker_pids()

        failed_after, out, stats, old_pids, new_pids = asyncio.run(run())
        assert failed_after < 30
        assert out.outputs[0].token_ids == expected[4]
        assert stats["num_worker_failures"] == 1
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert set(new_pids).isdisjoint(old_pids)


@pytest.mark.parametrize("bad", [-1, "fast", None])
def test_a_bad_stream_interval_fails_the_deploy_by_name(bad):
    from pagedserve.serving.serve_app import build_app

    with pytest.raises(ValueError, match=r"stream_interval_ms=.* must be a number of milliseconds"):
        build_app({"stream_interval_ms": bad})


def test_speculative_decoding_over_tensor_parallel_worker_actors(tiny_random):
    """Rows that verify proposals on 2 ranks (their draws shared with the others under async scheduling): greedy,
    seeded, penalized, constrained and scored requests give the tokens of the same ranks without speculation, and
    their logprobs to 1e-4 (gloo's all-reduce rounds a sum by the size of the whole step's tensor)."""
    from .test_speculative_engine import speculating, summary

    prompts = [f"Repeat exactly: {p} {p}" for p in PROMPTS[:5]]
    params = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=0.8, seed=5, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.2, logprobs=2),
              grammar_mix()[1], SamplingParams(temperature=0, max_tokens=16, n=2)]
    engine = dict(executor="ray", tensor_parallel_size=2, async_scheduling=True)
    with LLM(tiny_random, **engine) as llm:
        expected = [summary(o) for o in llm.generate(prompts, params)]
    llm = speculating(LLM(tiny_random, **engine,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    try:
        got = [summary(o) for o in llm.generate(prompts, params)]
        assert [[c[:5] for c in o] for o in got] == [[c[:5] for c in o] for o in expected]
        scored = [(g[0][5], e[0][5]) for g, e in zip(got, expected, strict=True) if e[0][5] is not None]
        for got_entries, want_entries in scored:
            assert [e[0] for e in got_entries] == [e[0] for e in want_entries]
            assert [e[1] for e in got_entries] == pytest.approx([e[1] for e in want_entries], abs=1e-4)
        stats = llm.stats()
        assert stats["spec_num_accepted_tokens"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        llm.shutdown()


def test_a_draft_model_on_a_worker_actor(tiny_random, tmp_path):
    """The draft loads and proposes inside the worker actor (its pool beside the model's): greedy tokens and
    logprobs to the bit of the in-process engine without speculation, every proposal of a draft equal to the model
    kept."""
    from .test_speculative_engine import speculating, summary

    prompts = [[1000, 1001, 1002, 1003] * 3 + [2000] * i for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    with LLM(tiny_random, block_size=4) as llm:
        expected = [summary(o) for o in llm.generate(prompts, params)]
    llm = speculating(LLM(tiny_random, block_size=4, executor="ray", speculative_config={
        "method": "draft_model", "model": tiny_random, "num_speculative_tokens": 3}))
    try:
        assert [summary(o) for o in llm.generate(prompts, params)] == expected
        stats = llm.stats()
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_proposed_tokens"] > 0
    finally:
        llm.shutdown()


def test_a_draft_model_over_tensor_parallel_worker_actors(tmp_path_factory, tiny_random):
    """Two ranks, steps scheduled ahead: rank 0 runs the draft whole and gives the other rank its proposals. The
    greedy tokens of the engine without speculation, with a draft equal to the model (every proposal kept) and with
    its first layer alone (some rejected)."""
    from .test_speculative_engine import ALPHABET, PREFIX, random_variant, speculating

    target = random_variant(tmp_path_factory, tiny_random, "untied_tp", tie_word_embeddings=False)
    first_layer = random_variant(tmp_path_factory, tiny_random, "first_layer_tp", tie_word_embeddings=False,
                                 num_hidden_layers=1)
    prompts = [PREFIX + [ALPHABET[(i * j) % 5] for j in range(20 + i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(target, block_size=4) as llm:
        expected = tokens(llm.generate(prompts, params))
    for draft, all_kept in ((target, True), (first_layer, False)):
        llm = speculating(LLM(target, block_size=4, executor="ray", tensor_parallel_size=2, async_scheduling=True,
                              speculative_config={"method": "draft_model", "model": draft,
                                                  "num_speculative_tokens": 3}))
        try:
            assert tokens(llm.generate(prompts, params)) == expected
            stats = llm.stats()
        finally:
            llm.shutdown()
        proposed, kept = stats["spec_num_proposed_tokens"], stats["spec_num_accepted_tokens"]
        assert (kept == proposed > 0) if all_kept else (0 < kept < proposed)


def test_lora_adapters_over_tensor_parallel_worker_actors(tmp_path):
    """Adapters of every target mixed with the base model on two ranks, one KV head held by both (each rank's
    share of q/k/v and gate/up's B, of o and down's A), two slots for three adapters, steps scheduled ahead of
    the loads they follow: each request's tokens are PEFT's."""
    import transformers

    from pagedserve import LoRARequest

    from .test_lora import ADAPTERS, make_adapter, peft_greedy
    from .test_lora import GREEDY as ADAPTER_GREEDY

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path / "base")
    names = ["all", "attn", "mlp"]
    for seed, name in enumerate(names):
        make_adapter(base, tmp_path / name, *ADAPTERS[name], seed=seed)
    adapters = [None] + [LoRARequest(name, i + 1, str(tmp_path / name)) for i, name in enumerate(names)]
    gen = torch.Generator().manual_seed(5)
    work = [(torch.randint(0, 300, (n,), generator=gen).tolist(), adapter) for n in (6, 21) for adapter in adapters]
    with LLM(str(tmp_path / "base"), executor="ray", tensor_parallel_size=2, block_size=4, enable_lora=True,
             max_loras=2, max_lora_rank=8, async_scheduling=True) as llm:
        outs = llm.generate([p for p, _ in work], ADAPTER_GREEDY, lora_request=[a for _, a in work])
    for (prompt, adapter), out in zip(work, outs, strict=True):
        name = adapter and adapter.lora_name
        assert out.outputs[0].token_ids == peft_greedy(tmp_path, name, prompt), name
