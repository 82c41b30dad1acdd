"""Built-in benchmark prompts, written for this project: code completion and chat.

Code prompts are raw text the model continues. Chat prompts are single user messages, rendered with
the target's chat template when its tokenizer has one (raw text otherwise).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

CODE_PROMPTS: tuple[str, ...] = (
    'def read_lines(path):\n    """Return the non-empty lines of a text file, stripped."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef walk_sizes(root):\n    total = 0\n    for dirpath, dirnames, filenames in os.walk(root):\n",
    'def parse_header(line):\n    """Split a "Key: value" header line into a (key, value) pair."""\n    key, _, value = ',
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n",
    "class Timer:\n    def __enter__(self):\n        self.start = time.monotonic()\n        return self\n\n",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n",
    'def is_palindrome(text):\n    """Ignore case and non-letters."""\n    letters = [c.lower() for c in text',
    "import json\n\n\ndef load_config(path, defaults=None):\n    with open(path) as handle:\n",
    "def chunked(iterable, size):\n    chunk = []\n    for item in iterable:\n        chunk.append(item)\n",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n        self.data = {}\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= high:\n",
    "import re\n\n_NUMBER = re.compile(r'-?\\d+')\n\n\ndef extract_numbers(text):\n",
    "def flatten(nested):\n    for item in nested:\n        if isinstance(item, (list, tuple)):\n",
    "class Vector:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __add__(self, other):\n",
    "def retry(func, attempts=3, delay=0.5):\n    last_error = None\n    for attempt in range(attempts):\n        try:\n",
    'def format_bytes(num):\n    """Human-readable size: 1536 -> \'1.5 KiB\'."""\n    for unit in ',
    "def transpose(matrix):\n    return [list(row) for row in zip(",
    "import argparse\n\n\ndef build_parser():\n    parser = argparse.ArgumentParser(description=",
    "def unique_everseen(iterable):\n    seen = set()\n    for element in iterable:\n",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n",
    "def gcd(a, b):\n    while b:\n",
    "def read_csv_rows(path):\n    import csv\n    with open(path, newline='') as handle:\n        reader = ",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n",
    "class EventBus:\n    def __init__(self):\n        self._handlers = {}\n\n    def subscribe(self, name, handler):\n",
    "def slugify(title):\n    title = title.strip().lower()\n    return ",
    "def histogram(values, bins=10):\n    low, high = min(values), max(values)\n    width = (high - low) / bins\n",
    "def deep_get(mapping, path, default=None):\n    current = mapping\n    for key in path.split('.'):\n",
    "if __name__ == '__main__':\n    import sys\n    args = sys.argv[1:]\n    if not args:\n",
)

CHAT_PROMPTS: tuple[str, ...] = (
    "How do I reverse a list in Python without changing the original?",
    "Explain the difference between a tuple and a list.",
    "Write a function that checks whether a number is prime.",
    "What does the `with` statement do when opening a file?",
    "How can I read a JSON file into a dictionary?",
    "Why does my loop skip items when I remove elements while iterating?",
    "Show me how to sort a list of dictionaries by one key.",
    "What is a generator and when should I use one?",
    "How do I measure how long a function takes to run?",
    "Explain what `*args` and `**kwargs` mean in a function definition.",
    "Write a class that represents a bank account with deposit and withdraw methods.",
    "How do I remove duplicate lines from a text file?",
    "What is the difference between `is` and `==`?",
    "How can I run two functions at the same time with threads?",
    "Give me a short example of a dataclass with default values.",
    "How do I split a string on several different separators?",
    "What happens when an exception is raised inside a `finally` block?",
    "Write a function that returns the n most common words in a text.",
    "How do I create a directory only if it does not exist yet?",
    "Explain list comprehensions with an example.",
    "How can I format a float with two decimal places?",
    "What is the purpose of `__init__.py` in a package?",
    "Write a small command-line tool that counts lines in files given as arguments.",
    "How do I copy a nested dictionary so that changes do not affect the original?",
    "What does the `yield from` expression do?",
    "How do I convert a string with a date into a datetime object?",
    "Explain how a decorator works, step by step.",
    "Write a function that merges two dictionaries, summing values of shared keys.",
    "How do I iterate over two lists in parallel?",
    "What is a context manager and how do I write my own?",
)

PROMPT_SETS = ("code", "chat", "mixed")


def select_prompts(prompt_set: str, num_prompts: int) -> list[tuple[str, str]]:
    """(kind, text) pairs: the first `num_prompts` of a set; `mixed` alternates code and chat."""
    if prompt_set == "code":
        return [("code", p) for p in CODE_PROMPTS[:num_prompts]]
    if prompt_set == "chat":
        return [("chat", p) for p in CHAT_PROMPTS[:num_prompts]]
    mixed = [
        pair
        for duo in zip(CODE_PROMPTS, CHAT_PROMPTS, strict=True)
        for pair in (("code", duo[0]), ("chat", duo[1]))
    ]
    return mixed[:num_prompts]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, kind: str, text: str) -> list[int]:
    """Token ids of one prompt: chat prompts through the chat template when there is one."""
    if kind == "chat" and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return tokenizer.encode(text, add_special_tokens=False)
