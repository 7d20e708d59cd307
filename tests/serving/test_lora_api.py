"""LoRA adapters served, as vLLM serves them: the OpenAI request's `model` names an adapter (the config's
`lora_modules`, or one loaded since through `/v1/load_lora_adapter`), `/v1/models` lists each with its parent,
gRPC's `adapter` field (the SDK's keyword) does the same; each answer is PEFT's. On a "lora" application of its own
with API keys, one adapter slot for two adapters."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import torch

from tests.serving.app import API_KEYS, BLOCK_BYTES, GRPC, HTTP, MAX_MODEL_LEN, POOL_BLOCKS
from tests.test_lora import make_adapter, peft_greedy

KEY = {"Authorization": f"Bearer {API_KEYS[0]}"}
PROMPT = [5, 77, 1234, 9, 401, 17]
TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_random):
    """tiny_random's shape saved by transformers (weights PEFT can load), its tokenizer, and two adapters."""
    import transformers

    root = tmp_path_factory.mktemp("served_lora")
    tiny = Path(tiny_random.removeprefix("random:")).parent
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny),
                                                         dtype=torch.float32).eval()
    base.save_pretrained(root / "base")
    for f in tiny.iterdir():
        if f.name != "config.json":  # the tokenizer and its chat template
            shutil.copy(f, root / "base" / f.name)
    make_adapter(base, root / "sql", 4, 8, False, ["q_proj", "v_proj", "down_proj"], seed=1)
    make_adapter(base, root / "chat", 8, 16, True, ["k_proj", "o_proj", "gate_proj", "up_proj"], seed=2)
    return root


def peft_tokens(root, adapter: str | None) -> list[int]:
    return peft_greedy(root, adapter, PROMPT, TOKENS)


@pytest.fixture(scope="module")
def lora_app(app, checkpoint):
    from ray import serve

    from pagedserve.serving.serve_app import build_app

    serve.run(build_app({"model": str(checkpoint / "base"), "max_model_len": MAX_MODEL_LEN,
                         "kv_cache_memory": POOL_BLOCKS * BLOCK_BYTES, "api_keys": API_KEYS, "enable_lora": True,
                         "max_loras": 1, "max_lora_rank": 8,
                         "lora_modules": [{"name": "sql", "path": str(checkpoint / "sql")}]}),
              name="lora", route_prefix="/lora")
    yield "lora"
    serve.delete("lora")


@pytest.fixture(scope="module")
def oai(lora_app):
    return openai.OpenAI(base_url=f"{HTTP}/{lora_app}/v1", api_key=API_KEYS[0], max_retries=0)


def completion_tokens(oai, model: str) -> list[int]:
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].model_extra["token_ids"]


def post(lora_app, route: str, body: dict, headers: dict | None = KEY) -> tuple[int, str]:
    """The status and body text of a POST of `body` as JSON."""
    request = urllib.request.Request(f"{HTTP}/{lora_app}/v1/{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_served_adapters_answer_as_peft_over_http_and_grpc(oai, lora_app, checkpoint):
    from pagedserve.client import Client

    base = oai.models.list().data[0].id
    cards = {m.id: m.model_dump() for m in oai.models.list().data}
    assert cards["sql"]["parent"] == base and cards["sql"]["root"] == str(checkpoint / "sql")
    assert cards[base]["parent"] is None and set(cards) == {base, "sql"}
    want = {name: peft_tokens(checkpoint, name) for name in (None, "sql")}
    assert want["sql"] != want[None]
    assert completion_tokens(oai, "sql") == want["sql"]
    assert completion_tokens(oai, base) == want[None]
    with Client(GRPC, application=lora_app, api_key=API_KEYS[0], timeout=120) as client:
        out = client.generate(PROMPT, adapter="sql", max_tokens=TOKENS, temperature=0, ignore_eos=True)
        assert out.token_ids == want["sql"]
        assert client.model_info()["adapters"] == ["sql"]


def test_adapters_load_and_unload_at_run_time_behind_the_keys(oai, lora_app, checkpoint, tmp_path):
    """A loaded adapter answers as PEFT's (swapping the one slot with the config's), lists, and once unloaded is
    NOT_FOUND by name; a broken one is refused naming the problem, and the server goes on serving."""
    from pagedserve.client import Client, NotFound

    body = {"lora_name": "chat", "lora_path": str(checkpoint / "chat")}
    assert post(lora_app, "load_lora_adapter", body, headers=None)[0] == 401
    assert post(lora_app, "load_lora_adapter", body) == (200, "Success: LoRA adapter 'chat' added successfully.")
    status, text = post(lora_app, "load_lora_adapter", body)
    assert status == 400 and "lora_name='chat': an adapter of that name is already loaded" in text
    assert {m.id for m in oai.models.list().data} >= {"sql", "chat"}
    assert completion_tokens(oai, "chat") == peft_tokens(checkpoint, "chat")
    assert completion_tokens(oai, "sql") == peft_tokens(checkpoint, "sql")

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint / "chat", broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps(config | {"r": 32}))
    status, text = post(lora_app, "load_lora_adapter", {"lora_name": "broken", "lora_path": str(broken)})
    assert status == 400 and "rank r=32 is over max_lora_rank=8" in text
    assert completion_tokens(oai, "chat") == peft_tokens(checkpoint, "chat")

    assert post(lora_app, "unload_lora_adapter", {"lora_name": "chat"}) == (
        200, "Success: LoRA adapter 'chat' removed successfully.")
    status, text = post(lora_app, "unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and "lora_name='chat': no adapter of that name is loaded" in text
    with pytest.raises(openai.NotFoundError, match="model='chat' is not served here"):
        oai.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    with Client(GRPC, application=lora_app, api_key=API_KEYS[0], timeout=60) as client:
        with pytest.raises(NotFound, match="adapter='chat' is not served here") as e:
            client.generate(PROMPT, adapter="chat", max_tokens=2)
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_lora_settings_are_refused_by_name_at_deploy_time():
    from pagedserve.serving.serve_app import build_app

    for args, says in [({"lora_modules": [{"name": "a", "path": "/a"}]}, "lora_modules needs enable_lora: true"),
                       ({"enable_lora": True, "lora_modules": [{"name": "a"}]}, "lora_modules\\[0\\]="),
                       ({"enable_lora": True, "lora_modules": ["a=/a", "a=/b"]}, "the name 'a' is given twice"),
                       ({"max_loras": 2}, "max_loras=2 needs enable_lora=True")]:
        with pytest.raises(ValueError, match=says):
            build_app(args)
