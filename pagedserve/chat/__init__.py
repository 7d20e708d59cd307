"""Chat requests: messages through the model's chat template (`template.py`), tools offered and tool calls parsed
(`tool_calls.py`), and reasoning between think tags (`reasoning.py`)."""
