"""`AdapterCatalog`, the application's table of the LoRA adapters it serves by name: the config's `lora_modules`,
and those loaded and unloaded over HTTP since. One replica, which every ingress replica asks, so that an adapter
loaded through one is served by all; the model replicas need no table (each request carries its adapter).

Each adapter gets an id never used before (a random one: the catalog may be restarted, and its successor must not
give an id to another adapter), so that the blocks a model replica's prefix cache filed under an adapter never
serve another one loaded under the same name."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from ray import serve

from pagedserve.lora.lora_request import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    """A served adapter as the config names it: `{name: ..., path: ...}` or vLLM's `name=path`."""

    name: str
    path: str

    @classmethod
    def parse_all(cls, modules: Any, enable_lora: bool) -> list[LoRAModule]:
        """ValueError naming the entry that is wrong."""
        if modules is None:
            return []
        if not isinstance(modules, list):
            raise ValueError(f"lora_modules={modules!r} must be a list of {{name: ..., path: ...}}")
        if modules and not enable_lora:
            raise ValueError("lora_modules needs enable_lora: true")
        parsed = [cls._parse(i, m) for i, m in enumerate(modules)]
        names = [m.name for m in parsed]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"lora_modules: the name {name!r} is given twice")
        return parsed

    @classmethod
    def _parse(cls, i: int, module: Any) -> LoRAModule:
        if isinstance(module, str) and "=" in module:
            name, path = module.split("=", 1)
            module = {"name": name, "path": path}
        if not isinstance(module, dict) or set(module) != {"name", "path"}:
            raise ValueError(f"lora_modules[{i}]={module!r} must be {{name: ..., path: ...}} or 'name=path'")
        for key in ("name", "path"):
            if not isinstance(module[key], str) or not module[key]:
                raise ValueError(f"lora_modules[{i}].{key}={module[key]!r} must be a non-empty string")
        return cls(module["name"], module["path"])


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1, max_ongoing_requests=4096)
class AdapterCatalog:
    def __init__(self, modules: list[LoRAModule]) -> None:
        self.adapters: dict[str, LoRARequest] = {}
        for module in modules:
            self.add(module.name, module.path)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def list(self) -> list[LoRARequest]:
        return list(self.adapters.values())

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as `name` (checked against the model by the caller); ValueError when the
        name is taken."""
        if name in self.adapters:
            raise ValueError(f"lora_name={name!r}: an adapter of that name is already loaded")
        self.adapters[name] = adapter = LoRARequest(name, secrets.randbits(62) + 1, path)
        return adapter

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name` (requests running with it finish); None when no such adapter is served."""
        return self.adapters.pop(name, None)
