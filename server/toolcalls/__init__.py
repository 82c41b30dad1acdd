"""Tool calling: tools rendered by the model's chat template, calls read back from its output.

detect.py (what the model's template and tokenizer allow), parsers.py (the formats),
json_scan.py + stream.py (the incremental reader), xml_stream.py + xml_values.py (its form for
Qwen's XML calls, values typed by the tools' schemas), output.py (OpenAI shapes), render.py
(messages and tools for templates), grammar.py (the calls' grammar),
plan.py (one request: tool_choice, grammar, limits).
"""
