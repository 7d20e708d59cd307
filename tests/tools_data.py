"""The tools, question and forcing regex that the tool-calling tests share (engine and served)."""

from __future__ import annotations

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Forces the embedded model's answer (a regex) into a Hermes-format call, for "auto" to parse: the model rarely
# calls on its own, so tests that use it check the parsing of a forced text, not the model's own calls.
HERMES_CALL = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", ' \
              r'"unit": "celsius"\}\}\n</tool_call>'
