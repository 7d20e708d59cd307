"""LoRA adapters over one base model: a request names its adapter (`request.py`), an adapter directory in PEFT's
format is read and checked against the model (`adapter.py`), and the scheduler keeps the adapters its running
sequences use in the workers' slots (`slots.py`). The workers add each row's adapter to its projections
(`workers/lora.py`, `workers/models/lora.py`)."""
