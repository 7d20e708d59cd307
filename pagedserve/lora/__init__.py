"""LoRA adapters over one base model: a request names its adapter (`lora_request.py`), an adapter directory in
PEFT's format is read and checked against the model (`adapter.py`), the engine checks each request's adapter before
it is queued (`registry.py`), and the scheduler keeps the adapters its running sequences use in the workers' slots
(`slots.py`). The workers load them (`workers/adapter_loader.py`) and add each row's adapter to its projections
(`workers/models/lora_layers.py`, the products in `kernels/lora_products.py`)."""
