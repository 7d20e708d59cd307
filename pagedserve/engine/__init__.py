"""The engine: input processing (`input_processor.py`), the step loop (`llm_engine.py`), output building
(`output_processor.py`), and the asyncio host of all three (`async_engine.py`)."""
