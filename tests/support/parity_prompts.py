"""The parity set: completion prompts every engine path is held to HF transformers on (test_server_parity.py), and
the paths that must equal one engine (prefill/decode disaggregation, test_disaggregation.py)."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "List three primary colors:\n1.",
    "Translate to French: 'The cat sleeps on the warm windowsill.'\nFrench:",
    "import numpy as np\n\n# compute the mean of each row of a matrix\ndef row_means(m):",
    "Q: Why is the sky blue?\nA:",
    "The quick brown fox",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Photosynthesis is the process by which plants " * 12,  # ~100 tokens: several chunks at budget 64
    "SELECT name, COUNT(*) FROM orders WHERE",
    "Dear hiring manager,\n\nI am writing to apply for",
    "Les mots français les plus courants sont",
    "1, 2, 3, 5, 8, 13, 21,",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a planet with rings.<|im_end|>\n"
    "<|im_start|>assistant\n",
]
